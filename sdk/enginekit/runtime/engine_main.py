"""The engine process's ``main``: read its arguments, watch its parent, run ``EngineCoreProc``, exit.

Started either as ``python -m enginekit.runtime.engine_main`` or forked by the launcher. The front end writes
one ``EngineProcArgs`` message on stdin and then keeps stdin open: EOF means the front end died, and the
engine exits, also while it loads a model. Any exception after startup is broadcast as ``EngineDead`` before
the process exits.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import BinaryIO

import torch

from enginekit.core.engine_core_proc import EngineCoreProc, terminate_context
from enginekit.wire.messages import EngineProcArgs
from enginekit.wire.serial import read_frame

logger = logging.getLogger("enginekit.engine_process")

ORPHAN_GRACE_S = 2.0
LOG_FORMAT = "%(asctime)s engine[%(process)d] %(levelname)s %(name)s: %(message)s"


def run_engine_core(args: EngineProcArgs, on_started: Callable[[EngineCoreProc], None] | None = None) -> int:
    """Run until shut down; any exception is broadcast as ``EngineDead``. Returns the exit code.

    ``on_started`` sees the engine once it is up and its signal handlers are in place (a remote rank routes
    its own there)."""
    engine: EngineCoreProc | None = None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def early_signal(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # during startup: just stop loading

    for sig in previous:
        signal.signal(sig, early_signal)
    try:
        engine = EngineCoreProc(args)
        for sig in previous:
            signal.signal(sig, engine.signal_shutdown)
        if on_started is not None:
            on_started(engine)
        engine.run_busy_loop()
        if engine.shutdown_signal is not None:
            # Not the front end's shutdown: the calls waiting on this engine fail, naming the signal.
            signum = signal.Signals[engine.shutdown_signal]
            engine.send_engine_dead(f"it received {engine.shutdown_signal}", engine.shutdown_signal)
            return 128 + signum
        engine.close_io()
        return 0
    except SystemExit:
        raise
    except BaseException as error:
        logger.exception("engine core failed")
        if engine is not None:
            engine.send_engine_dead(f"{type(error).__name__}: {error}")
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if engine is not None:
            engine.closing = True
            engine.shutdown()
            gc.unfreeze()
            terminate_context(engine._zmq)


def _watch_parent(stdin: BinaryIO) -> None:
    """The parent holds our stdin open; EOF means it died: shut down, and exit hard if that hangs."""
    try:
        while stdin.read(4096):
            pass
    except OSError:
        pass
    logger.warning("front-end process is gone; engine process exiting")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(ORPHAN_GRACE_S)
    os._exit(3)


def default_num_threads() -> int:
    """torch threads of an engine process: every core this process may use (see ``engine_environ``)."""
    return max(1, len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else 1


def main() -> None:
    # A crash in native code (a segfault, an abort) then leaves the crashing stack in the error tail.
    faulthandler.enable(all_threads=False)
    stdin = sys.stdin.buffer
    try:
        args = read_frame(stdin, EngineProcArgs)
    except EOFError:
        os._exit(3)  # the front end went away before it sent our arguments
    logging.basicConfig(level=args.config.log_level.upper(), stream=sys.stderr, format=LOG_FORMAT)
    threading.Thread(target=_watch_parent, args=(stdin,), name="enginekit-parent-watch", daemon=True).start()
    # NOTE: every core; the engine runs fewer while other processes keep them busy (``core/threads.py``).
    torch.set_num_threads(args.config.num_threads or default_num_threads())
    try:
        code = run_engine_core(args)
    except SystemExit as exit_request:  # a signal during startup
        code = exit_request.code if isinstance(exit_request.code, int) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # NOTE: daemon IO threads may sit in blocking socket calls; do not wait for them


if __name__ == "__main__":
    main()
