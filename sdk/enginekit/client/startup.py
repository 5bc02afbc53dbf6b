"""Starting a front end's engine processes — one per data-parallel rank — side by side, and the handshake.

Every rank's process is started first; then the front end waits for each one's READY on the input socket, taking
its phase reports on the way. A rank that dies or hangs fails the whole start with ``EngineStartupError`` naming
the rank (when there are several), the phase and the child's own error first; the caller then stops every rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from enginekit.client.remote import RemoteRank
from enginekit.client.sockets import EngineSockets
from enginekit.config import EngineConfig
from enginekit.errors import EngineStartupError
from enginekit.model.config import ModelConfig
from enginekit.runtime.engine_process import EngineProcess
from enginekit.runtime.launcher import LauncherError
from enginekit.wire.messages import EngineProcArgs, PhaseReport, ReadyMessage, StartupReport, engine_identity

logger = logging.getLogger("enginekit.client")

REPORT_GRACE_MS = 200  # how long a dead engine's last reports may still take to arrive


@dataclass
class EngineRank:
    """One engine process of a front end: its data-parallel rank, routing identity and handshake."""

    rank: int
    process: EngineProcess | RemoteRank
    ready: ReadyMessage | None = None

    @property
    def identity(self) -> bytes:
        return engine_identity(self.rank)


def spawn_engines(config: EngineConfig, sockets: EngineSockets, engines: list[EngineRank]) -> None:
    """Start every local rank's process; hand each remote rank the arguments it gets when it joins."""
    for engine in engines:
        args = EngineProcArgs(
            rank_config(config, engine.rank),
            sockets.input_address,
            sockets.output_address,
            engine.rank,
            *sockets.curve_client_keys,
        )
        try:
            engine.process.start(args)
        except (OSError, LauncherError) as error:
            raise EngineStartupError(
                f"{_who(engines, engine)}cannot start the engine process: {error}", phase="spawn"
            ) from error


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config one rank runs with: its own GPU (``rank_device``), and its share of the CPU's threads.

    A remote rank (and a rank Ray placed) runs the config as given: its host has its own devices and cores."""
    # NOTE: with external load balancing, the other ranks share the machine too.
    num_ranks = local_rank_count(config)
    if num_ranks <= 1 or rank in config.data_parallel_remote_ranks:
        return config
    changes: dict[str, object] = {}
    device = config.device or ("cuda" if _cuda_available() else "cpu")
    if device == "cuda":
        changes["device"] = rank_device(config, rank, _visible_cuda_devices())
    if config.num_threads is None and not device.startswith("cuda"):
        # NOTE: the cores are shared out; a rank with several runs fewer while the others keep them busy.
        changes["num_threads"] = max(1, usable_cores() // num_ranks)
    return config.replace(**changes) if changes else config


def rank_device(config: EngineConfig, rank: int, visible: int) -> str:
    """The CUDA device of data-parallel ``rank`` among the ``visible`` ones (the placement rules; see
    docs/architecture.md, "GPU placement").

    - Internal load balancing (this front end starts every local rank): rank r runs on ``cuda:r`` and needs
      ``data_parallel_size_local`` (or ``data_parallel_size``) visible devices: vLLM's rule for ranks started
      together (local rank r takes the r-th slice of the visible devices).
    - External load balancing (``data_parallel_rank=r``, one front end per rank): a process that sees exactly one
      device runs on it, ``cuda:0``: the usual setup of ``CUDA_VISIBLE_DEVICES=r`` per process (as vLLM's external
      load balancing is launched), or one rank per host. A process that sees every rank's device runs rank r on
      ``cuda:r``. Any other count is ambiguous and refused.

    Under tensor parallelism (``tensor_parallel_size=N``) each rank's engine needs N devices in a row: rank r runs
    on ``cuda:r*N`` and its model rank t on ``cuda:r*N+t``; a process that sees exactly N devices runs its one rank
    on ``cuda:0``. A rank Ray placed is such a process: its actor sees the N GPUs of its bundle, so model rank t
    runs on ``cuda:t`` (this function is not called for it; the engine runs on ``device="cuda"``, i.e. ``cuda:0``).
    """
    external = config.data_parallel_rank is not None
    tp = config.tensor_parallel_size
    if external and visible == tp:
        return "cuda:0"
    size = local_rank_count(config)
    if visible >= size * tp:
        return f"cuda:{rank * tp}"
    name = "data_parallel_size_local" if config.data_parallel_remote_ranks else "data_parallel_size"
    per = f" ({tp} each: tensor_parallel_size={tp})" if tp > 1 else ""
    if external:
        if tp == 1:
            raise ValueError(
                f"data_parallel_rank={rank} of {name}={size} with {visible} visible CUDA devices: give each "
                f"rank's process one device (CUDA_VISIBLE_DEVICES={rank}), or let it see all {size} (rank r runs "
                "on cuda:r)"
            )
        raise ValueError(
            f"data_parallel_rank={rank} of {name}={size} with {visible} visible CUDA devices: give each rank's "
            f"process its own{per}, or let it see all {size * tp} (rank r runs on cuda:r*{tp})"
        )
    raise ValueError(
        f"{name}={size} needs {size * tp} CUDA devices{per} (rank r runs on cuda:{'r' if tp == 1 else f'r*{tp}'}), "
        f"{visible} visible"
    )


def check_placement(config: EngineConfig) -> None:
    """Refuse more ranks than devices (GPUs on CUDA, cores on CPU), before anything starts. Ranks Ray places are
    the cluster's to fit: each bundle asks for its rank's devices (``client/ray_ranks.py``)."""
    size = local_rank_count(config)
    tp = config.tensor_parallel_size
    if (
        tp > 1
        and config.data_parallel_backend != "ray"
        and size <= 1
        and (config.device or ("cuda" if _cuda_available() else "cpu")).startswith("cuda")
    ):
        visible = _visible_cuda_devices()
        if visible < tp:
            raise ValueError(f"tensor_parallel_size={tp} needs {tp} CUDA devices, {visible} visible")
    if size <= 1:
        return
    name = "data_parallel_size_local" if config.data_parallel_remote_ranks else "data_parallel_size"
    device = config.device or ("cuda" if _cuda_available() else "cpu")
    if device.startswith("cuda"):
        if device != "cuda":
            raise ValueError(f"{name}={size} places rank r on cuda:r: give device='cuda', not {device!r}")
        visible = _visible_cuda_devices()
        for rank in config.data_parallel_ranks:
            if rank not in config.data_parallel_remote_ranks:
                rank_device(config, rank, visible)
    elif size > usable_cores():
        raise ValueError(
            f"{name}={size} needs a CPU core per rank, and this process may use {usable_cores()}"
        )


def local_rank_count(config: EngineConfig) -> int:
    """The ranks that share this machine: every rank, less those that run elsewhere (all of them on Ray)."""
    if config.data_parallel_backend == "ray":
        return 0
    return config.data_parallel_size - len(config.data_parallel_remote_ranks)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _visible_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def wait_for_ready(
    config: EngineConfig, sockets: EngineSockets, engines: list[EngineRank], model: ModelConfig | None = None
) -> None:
    """Take every rank's phase reports until each has reported READY, within ``startup_timeout`` (or raise);
    then check that each loaded ``model``, the one the front end tokenizes for."""
    deadline = time.monotonic() + config.startup_timeout
    by_identity = {engine.identity: engine for engine in engines}
    decoder = msgspec.msgpack.Decoder(StartupReport)
    while any(engine.ready is None for engine in engines):
        if sockets.input.poll(100):
            _take_report(sockets, by_identity, decoder)
            continue
        for engine in engines:
            if engine.ready is None and not engine.process.is_alive():
                # NOTE: its last reports may still be on their way (sent just before it exited): take them,
                # so the error names the phase it failed in.
                while sockets.input.poll(REPORT_GRACE_MS):
                    _take_report(sockets, by_identity, decoder)
                process = engine.process
                raise startup_error(
                    f"{_who(engines, engine)}engine startup failed during {process.phase}: {process.describe_exit()}",
                    process,
                )
        if time.monotonic() > deadline:
            stuck = next(engine for engine in engines if engine.ready is None)
            phase = stuck.process.phase
            stuck.process.stop(0.0)
            ending = "the engine process was killed"
            if isinstance(stuck.process, RemoteRank):
                ending = "it runs elsewhere: the front end stopped waiting"
            raise startup_error(
                f"{_who(engines, stuck)}engine did not report READY within startup_timeout="
                f"{config.startup_timeout}s (stuck in {phase}); {ending}",
                stuck.process,
                phase,
            )
    if model is not None:
        _check_models(config, engines, model)


def _check_models(config: EngineConfig, engines: list[EngineRank], model: ModelConfig) -> None:
    """A rank that loaded another model (a remote rank's ``--model`` that is not the same one) fails the start:
    its tokens would be decoded with the wrong vocabulary, or its outputs differ from the other ranks'."""
    for engine in engines:
        if engine.ready is None or engine.ready.model is None:
            continue
        loaded = msgspec.convert(engine.ready.model, ModelConfig)
        if loaded == model:
            continue
        differences = ", ".join(
            f"{name} {getattr(loaded, name)!r} (front end: {getattr(model, name)!r})"
            for name in model.__struct_fields__
            if getattr(loaded, name) != getattr(model, name)
        )
        raise EngineStartupError(
            f"{_who(engines, engine)}the engine loaded another model than the front end's "
            f"{config.model or 'default model'!r} (a remote rank's --model must be the same model): {differences}",
            phase="model check",
        )


def _take_report(
    sockets: EngineSockets, by_identity: dict[bytes, EngineRank], decoder: msgspec.msgpack.Decoder[Any]
) -> None:
    """Apply one startup message: a phase report, or READY."""
    frames = sockets.input.recv_multipart()
    engine = by_identity.get(frames[0]) if len(frames) == 2 else None
    report = None
    if engine is not None:
        with contextlib.suppress(msgspec.MsgspecError):
            report = decoder.decode(frames[1])
    if engine is not None and isinstance(report, ReadyMessage):
        engine.ready = report
    elif engine is not None and isinstance(report, PhaseReport):
        engine.process.phase = report.phase
    else:
        logger.warning("ignored an unexpected message during the handshake")


def startup_error(
    headline: str, process: EngineProcess | RemoteRank, phase: str | None = None
) -> EngineStartupError:
    """The error leads with the child's own exception, then says what happened, then shows its output."""
    tail = process.error_tail()
    cause = _last_error_line(tail)
    message = f"{cause}\n{headline}." if cause else f"{headline}."
    if tail:
        message += f"\nLast engine output:\n{tail}"
    return EngineStartupError(message, phase=phase or process.phase, error_tail=tail)


def _who(engines: list[EngineRank], engine: EngineRank) -> str:
    return f"engine rank {engine.rank}: " if len(engines) > 1 or engine.rank else ""


def _last_error_line(tail: str) -> str:
    """The exception line of a traceback in the engine's output, to lead the startup error with."""
    for line in reversed(tail.splitlines()):
        if (
            line
            and not line.startswith((" ", "\t", "Traceback"))
            and ("Error" in line or "Exception" in line)
        ):
            return line.strip()
    return ""
