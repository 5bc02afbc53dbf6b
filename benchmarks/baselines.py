"""Engine-independent baselines, measured in the same run as the engine benchmarks.

Each baseline states a floor or a ceiling the engine is compared against:

* ``zmq_pingpong_roundtrip`` / ``zmq_message_rate``: what raw pyzmq costs between two
  processes on this machine (the engine's client <-> core transport cannot beat it);
* ``torch_import_time``: the fixed cost of starting a process that imports torch;
* ``hf_generate_runner``: tokens/s of ``transformers`` ``generate`` on a batch (dynamic or static cache,
  eager or compiled, float32 or bfloat16);
* ``hf_batch_runner``: tokens/s of transformers' continuous batching (``generate_batch``'s scheduler).

Everything runs locally: sockets are ``ipc://`` in a private temporary directory (or
``tcp://127.0.0.1`` where ipc is unavailable), models load from a local directory only, and
every wait has a timeout so no loop can hang.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

try:  # run as part of a package (python -m benchmarks.x) or as a script (benchmarks/x.py)
    from .stats import Summary, percentile, summarize
except ImportError:
    from stats import Summary, percentile, summarize

if TYPE_CHECKING:
    import torch

__all__ = [
    "BatchCapacity",
    "clear_model_cache",
    "hf_batch_runner",
    "hf_generate_runner",
    "import_time",
    "torch_import_time",
    "zmq_message_rate",
    "zmq_pingpong_roundtrip",
]

# How long any single wait on a child process or socket may take before the baseline fails.
_IO_TIMEOUT_S = 30.0
_GENERATE_TIMEOUT_S = 600.0  # one batch's generation: past this it is hung, not slow
_CHILD_START_TIMEOUT_S = 60.0


# --------------------------------------------------------------------------------------
# pyzmq helpers
# --------------------------------------------------------------------------------------

# Echo peer for the round-trip baseline: a DEALER that says hello, then echoes every
# message back until it receives the stop word (or has echoed max_msgs, or times out).
_PINGPONG_CHILD = r"""
import sys
import zmq

addr, max_msgs, timeout_ms = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 2000)
sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
sock.connect(addr)
rc = 0
try:
    sock.send(b"hello")
    for _ in range(max_msgs):
        msg = sock.recv()
        if msg == b"stop":
            break
        sock.send(msg)
except zmq.Again:
    rc = 3
finally:
    sock.close()
    ctx.term()
sys.exit(rc)
"""

# Sender for the message-rate baseline: PUSH data, PULL commands. Each command is a decimal
# count of single-frame messages to send; "0" ends it.
_RATE_CHILD = r"""
import sys
import zmq

ctrl_addr, data_addr = sys.argv[1], sys.argv[2]
payload_bytes, max_cmds, timeout_ms = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
payload = b"x" * payload_bytes
ctx = zmq.Context()
ctrl = ctx.socket(zmq.PULL)
ctrl.setsockopt(zmq.LINGER, 0)
ctrl.setsockopt(zmq.RCVTIMEO, timeout_ms)
data = ctx.socket(zmq.PUSH)
data.setsockopt(zmq.LINGER, 2000)
data.setsockopt(zmq.SNDTIMEO, timeout_ms)
ctrl.connect(ctrl_addr)
data.connect(data_addr)
rc = 0
try:
    data.send(b"ready")
    for _ in range(max_cmds):
        n = int(ctrl.recv())
        if n <= 0:
            break
        send = data.send
        for _ in range(n):
            send(payload)
except zmq.Again:
    rc = 3
finally:
    ctrl.close()
    data.close()
    ctx.term()
sys.exit(rc)
"""


@contextlib.contextmanager
def _endpoints(*names: str) -> Iterator[list[str]]:
    """Private ipc:// endpoints in a fresh temp dir (tcp loopback where ipc is unavailable)."""
    import zmq

    if zmq.has("ipc"):
        tmp = tempfile.mkdtemp(prefix="ekbench-")
        try:
            yield [f"ipc://{os.path.join(tmp, n)}.sock" for n in names]
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    else:
        # Port 0 is not accepted by zmq; "*" picks a free one, resolved after bind.
        yield ["tcp://127.0.0.1:*" for _ in names]


def _bind(sock: Any, endpoint: str) -> str:
    import zmq

    sock.bind(endpoint)
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def _start_child(source: str, *args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", source, *(str(a) for a in args)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _finish_child(proc: subprocess.Popen, *, check: bool) -> None:
    """Wait (bounded) for a child; kill it if it does not exit. Raise if check and it failed."""
    try:
        _, err = proc.communicate(timeout=_IO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=_IO_TIMEOUT_S)
    if check and proc.returncode != 0:
        msg = err.decode(errors="replace").strip()[-2000:]
        raise RuntimeError(f"benchmark peer process exited with {proc.returncode}: {msg}")


def _recv_or_fail(sock: Any, proc: subprocess.Popen, timeout_s: float, what: str) -> Any:
    """Receive one (multipart) message, failing clearly if the peer died or went quiet."""
    import zmq

    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no {what} from the benchmark peer within {timeout_s:.0f}s")
        if sock.poll(min(remaining, 0.5) * 1000.0, zmq.POLLIN):
            return sock.recv_multipart()
        if proc.poll() is not None:
            _finish_child(proc, check=True)
            raise RuntimeError(f"benchmark peer exited before sending {what}")


def zmq_pingpong_roundtrip(
    num_messages: int = 2000,
    payload_bytes: int = 64,
    *,
    warmup: int = 200,
) -> dict[str, Any]:
    """Round-trip latency of raw pyzmq between two processes.

    A ROUTER in this process and a DEALER in a child process (``python -c``), connected over
    ``ipc://`` in a private temp dir. Each round trip is: the ROUTER sends one
    ``payload_bytes`` frame to the DEALER, which echoes it; the time from send to the echo's
    arrival is one sample. ``warmup`` round trips are run first and discarded.

    Returns ``{"p50_us", "p99_us", "summary" (Summary in microseconds), "samples_us" (every
    round trip, sorted), "num_messages", "payload_bytes"}``.
    """
    import zmq

    if num_messages < 1:
        raise ValueError("num_messages must be >= 1")
    payload = os.urandom(payload_bytes)
    total = warmup + num_messages
    timeout_ms = int(_IO_TIMEOUT_S * 1000)
    ctx = zmq.Context()
    proc = None
    try:
        with _endpoints("pingpong") as (endpoint,):
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.RCVTIMEO, timeout_ms)
            router.setsockopt(zmq.SNDTIMEO, timeout_ms)
            addr = _bind(router, endpoint)
            proc = _start_child(_PINGPONG_CHILD, addr, total + 1, timeout_ms)
            ident, hello = _recv_or_fail(router, proc, _CHILD_START_TIMEOUT_S, "hello")
            if hello != b"hello":
                raise RuntimeError(f"unexpected greeting from the benchmark peer: {hello!r}")

            send = router.send_multipart
            recv = router.recv_multipart
            clock = time.perf_counter_ns
            samples_ns = []
            for i in range(total):
                t0 = clock()
                send([ident, payload])
                _, echo = recv()
                t1 = clock()
                if i >= warmup:
                    samples_ns.append(t1 - t0)
            if echo != payload:
                raise RuntimeError("echo does not match the payload sent")
            send([ident, b"stop"])
            _finish_child(proc, check=True)
            proc = None
            router.close()
    finally:
        if proc is not None:
            _finish_child(proc, check=False)
        ctx.destroy(linger=0)

    us = sorted(s / 1e3 for s in samples_ns)
    return {
        "p50_us": percentile(us, 50.0),
        "p99_us": percentile(us, 99.0),
        "summary": summarize(us),
        "samples_us": us,
        "num_messages": num_messages,
        "payload_bytes": payload_bytes,
    }


def zmq_message_rate(
    num_messages: int = 10000,
    payload_bytes: int = 64,
    *,
    repeats: int = 5,
    warmup_messages: int = 1000,
) -> dict[str, Any]:
    """One-way message rate of raw pyzmq between two processes, end to end.

    A child process (``python -c``) PUSHes single-frame ``payload_bytes`` messages to a PULL
    socket in this process over ``ipc://``. Each repeat is timed from the moment this
    process sends the "go" command (over a second PUSH/PULL pair) until the last of the
    ``num_messages`` messages has been received here, so it includes the command's delivery,
    the child's sending, the transport and this process's receiving. A warm-up burst of
    ``warmup_messages`` runs first.

    Returns ``{"summary" (Summary in messages/s over the repeats), "msgs_per_s" (median),
    "mb_per_s" (median payload MB/s, 1 MB = 1e6 bytes), "num_messages", "payload_bytes"}``.
    """
    import zmq

    if num_messages < 1 or repeats < 1:
        raise ValueError("num_messages and repeats must be >= 1")
    timeout_ms = int(_IO_TIMEOUT_S * 1000)
    ctx = zmq.Context()
    proc = None
    rates = []
    try:
        with _endpoints("ctrl", "data") as (ctrl_ep, data_ep):
            ctrl = ctx.socket(zmq.PUSH)
            ctrl.setsockopt(zmq.LINGER, 0)
            ctrl.setsockopt(zmq.SNDTIMEO, timeout_ms)
            data = ctx.socket(zmq.PULL)
            data.setsockopt(zmq.LINGER, 0)
            data.setsockopt(zmq.RCVTIMEO, timeout_ms)
            ctrl_addr = _bind(ctrl, ctrl_ep)
            data_addr = _bind(data, data_ep)
            proc = _start_child(_RATE_CHILD, ctrl_addr, data_addr, payload_bytes, repeats + 2, timeout_ms)
            (ready,) = _recv_or_fail(data, proc, _CHILD_START_TIMEOUT_S, "ready")
            if ready != b"ready":
                raise RuntimeError(f"unexpected greeting from the benchmark peer: {ready!r}")

            recv = data.recv
            if warmup_messages > 0:
                ctrl.send(str(warmup_messages).encode())
                for _ in range(warmup_messages):
                    recv()
            for _ in range(repeats):
                t0 = time.perf_counter()
                ctrl.send(str(num_messages).encode())
                for _ in range(num_messages):
                    msg = recv()
                elapsed = time.perf_counter() - t0
                if len(msg) != payload_bytes:
                    raise RuntimeError("received a message of the wrong size")
                rates.append(num_messages / elapsed)
            ctrl.send(b"0")
            _finish_child(proc, check=True)
            proc = None
            ctrl.close()
            data.close()
    finally:
        if proc is not None:
            _finish_child(proc, check=False)
        ctx.destroy(linger=0)

    summary = summarize(rates)
    return {
        "summary": summary,
        "msgs_per_s": summary.median,
        "mb_per_s": summary.median * payload_bytes / 1e6,
        "num_messages": num_messages,
        "payload_bytes": payload_bytes,
    }


# --------------------------------------------------------------------------------------
# Process start-up
# --------------------------------------------------------------------------------------


def import_time(module: str, repeats: int = 5, *, warmup: int = 1) -> Summary:
    """Wall time (seconds) of ``python -c "import <module>"`` in a fresh process.

    Uses this interpreter (``sys.executable``, i.e. the venv's python). ``warmup`` runs come
    first and are discarded, so the figure is the warm-page-cache start-up cost.
    """
    if not module.replace(".", "").replace("_", "").isalnum():
        raise ValueError(f"not a module name: {module!r}")
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    cmd = [sys.executable, "-c", f"import {module}"]
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        res = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=300,
            check=False,
        )
        elapsed = time.perf_counter() - t0
        if res.returncode != 0:
            err = res.stderr.decode(errors="replace").strip()[-2000:]
            raise RuntimeError(f"`import {module}` failed with {res.returncode}: {err}")
        if i >= warmup:
            times.append(elapsed)
    return summarize(times)


def torch_import_time(repeats: int = 5) -> Summary:
    """Wall time (seconds) of ``python -c "import torch"`` with this interpreter."""
    return import_time("torch", repeats)


# --------------------------------------------------------------------------------------
# Compute
# --------------------------------------------------------------------------------------


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    import torch

    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"unknown torch dtype {dtype!r}")
        return resolved
    return dtype


# --------------------------------------------------------------------------------------
# transformers generate
# --------------------------------------------------------------------------------------

_MODEL_CACHE: dict[str, Any] = {}


def clear_model_cache() -> None:
    """Stop the continuous-batching managers and drop the models the runners keep between calls."""
    while _MANAGERS:
        _stop_manager(_MANAGERS.popitem()[1][1])
    _MODEL_CACHE.clear()
    gc.collect()


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars for the duration (restored afterwards)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _load_model(checkpoint_path: str | os.PathLike, dtype: str = "float32", compiled: bool = False) -> Any:
    """Load a causal LM offline from a local folder or a ``.gguf`` file (dequantized), in ``dtype``;
    ``compiled``: its forward wrapped in ``torch.compile(dynamic=True)`` (compiled at the first calls).

    Cached until ``clear_model_cache``: loading a dequantized GGUF takes seconds, and a compiled model keeps
    what it compiled.
    """
    import torch

    path = os.path.realpath(os.fspath(checkpoint_path))
    is_gguf = path.endswith(".gguf") and os.path.isfile(path)
    if not (is_gguf or os.path.isdir(path)):
        raise FileNotFoundError(f"checkpoint folder or .gguf file not found: {path}")
    key = f"{path}:{dtype}:{compiled}"
    model = _MODEL_CACHE.get(key)
    if model is not None:
        return model
    if any(not name.startswith(f"{path}:") for name in _MODEL_CACHE):
        clear_model_cache()  # another checkpoint's models
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    folder, gguf = path, {}
    if is_gguf:  # dequantized to plain dense weights, as the engine computes with them
        from transformers import GgufConfig

        folder = os.path.dirname(path)
        name = os.path.basename(path)
        gguf = {"gguf_file": name, "quantization_config": GgufConfig(gguf_file=name, dequantize=True)}
    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=_resolve_dtype(dtype), local_files_only=True, **gguf
        )
    model.eval()
    if compiled:
        model.forward = torch.compile(model.forward, dynamic=True)
    _MODEL_CACHE[key] = model
    return model


def _per_request(values: Sequence[int] | int, batch_size: int, name: str) -> list[int]:
    if isinstance(values, int):
        values = [values]
    values = [int(v) for v in values]
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{name} must be a non-empty list of positive ints")
    return [values[i % len(values)] for i in range(batch_size)]


def hf_generate_runner(
    checkpoint_path: str | os.PathLike,
    batch_size: int,
    prompt_lens: Sequence[int] | int,
    max_new_tokens: Sequence[int] | int,
    *,
    seed: int = 0,
    num_threads: int | None = None,
    dtype: str = "float32",
    cache: str = "dynamic",
    compiled: bool = False,
) -> Callable[[], float]:
    """One ``generate`` call per invocation, returning its tokens/s: the tokens each request asked for (a
    batch runs until its longest request ends; what the others compute past their end does not count) over
    the wall time of the whole call (prefill included).

    The model is loaded and the batch built once, when this is called; each invocation then times one
    ``generate`` call under ``num_threads`` torch threads (restored afterwards), with every warning
    raised as an error. Lets a caller interleave transformers samples with other measurements. ``cache``:
    ``"dynamic"`` (transformers' default, grown per step) or ``"static"`` (preallocated for the longest
    request); ``compiled``: the model's forward through ``torch.compile`` (see ``_load_model``).
    """

    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if num_threads is not None and num_threads < 1:
        raise ValueError("num_threads must be >= 1 or None")
    plens = _per_request(prompt_lens, batch_size, "prompt_lens")
    wanted = _per_request(max_new_tokens, batch_size, "max_new_tokens")
    with warnings.catch_warnings(), _RaiseOnTransformersWarning():
        # Any warning is an error: a silently degraded baseline is worse than none.
        warnings.simplefilter("error")
        # torch.compile's tracing trips over deprecated torch APIs: a deprecation does not degrade the baseline
        warnings.simplefilter("ignore", DeprecationWarning)
        model = _load_model(checkpoint_path, dtype, compiled)
        run_once = _prepare_generate(model, plens, wanted, seed, cache)

    def timed() -> float:
        with _strict_timing(num_threads):
            t0 = time.perf_counter()
            tokens = run_once()
            elapsed = time.perf_counter() - t0
        if tokens != sum(wanted):
            raise RuntimeError(f"generate produced {tokens} of the {sum(wanted)} wanted tokens")
        return tokens / elapsed

    return timed


@dataclass(frozen=True)
class BatchCapacity:
    """What a continuous-batching manager is sized for: requests at once and tokens per request."""

    requests: int
    tokens_per_request: int

    def holds(self, other: BatchCapacity) -> bool:
        return self.requests >= other.requests and self.tokens_per_request >= other.tokens_per_request


_MANAGERS: dict[str, tuple[BatchCapacity, Any]] = {}  # checkpoint and dtype -> a started manager


def hf_batch_runner(
    checkpoint_path: str | os.PathLike,
    prompt_lens: Sequence[int],
    max_new_tokens: Sequence[int],
    *,
    seed: int = 0,
    num_threads: int | None = None,
    dtype: str = "float32",
    capacity: BatchCapacity | None = None,
) -> Callable[[], float]:
    """transformers' continuous batching, the scheduler behind ``model.generate_batch``: one call adds the batch's
    requests to a running manager (``model.init_continuous_batching``), each with its own ``max_new_tokens``, and
    waits for all of them; returns the call's tokens/s (prefill included). No padding: each request stops at its
    own length. Fresh random prompts per call (built before the clock starts), so no call finds an earlier one's
    prompts in the manager's prefix cache.

    The manager is started once per checkpoint and dtype, sized for ``capacity`` (or this batch), and kept for
    later batches it holds, as a server keeps it, until ``clear_model_cache``; ``generate_batch`` would build and
    size one per call. Its attention: the model's (sdpa), as ``generate_batch`` keeps it on a CPU, where flash
    attention kernels do not run.
    """
    import torch

    plens, wanted = list(prompt_lens), list(max_new_tokens)
    if len(plens) != len(wanted) or not plens or min(plens + wanted) < 1:
        raise ValueError("prompt_lens and max_new_tokens need one positive entry per request")
    needed = BatchCapacity(len(plens), max(p + o for p, o in zip(plens, wanted)))
    with warnings.catch_warnings(), _RaiseOnTransformersWarning():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", DeprecationWarning)
        model = _load_model(checkpoint_path, dtype)
        manager = _manager(model, f"{os.path.realpath(checkpoint_path)}:{dtype}", capacity or needed, needed)
    vocab, special = _token_space(model)
    generator = torch.Generator().manual_seed(seed)

    def timed() -> float:
        prompts = [_random_ids(n, vocab, special, generator) for n in plens]
        with _strict_timing(num_threads):
            t0 = time.perf_counter()
            ids = [
                manager.add_request(input_ids=prompt, max_new_tokens=n) for prompt, n in zip(prompts, wanted)
            ]
            tokens = _collect(manager, set(ids))
            elapsed = time.perf_counter() - t0
        if tokens != sum(wanted):
            raise RuntimeError(f"generate_batch produced {tokens} of the {sum(wanted)} wanted tokens")
        return tokens / elapsed

    return timed


def _manager(model: Any, key: str, capacity: BatchCapacity, needed: BatchCapacity) -> Any:
    """The started manager for ``key`` if it holds ``needed``, else a new one sized for the larger of the two."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    cached = _MANAGERS.get(key)
    if cached is not None and cached[0].holds(needed):
        return cached[1]
    if cached is not None:
        _stop_manager(_MANAGERS.pop(key)[1])
    capacity = BatchCapacity(
        max(capacity.requests, needed.requests), max(capacity.tokens_per_request, needed.tokens_per_request)
    )
    page = 256  # the manager's default page of KV cache, in tokens
    config = ContinuousBatchingConfig(
        page_size=page,
        # the whole batch at once, no more: on a CPU the manager would otherwise take 60% of the free memory
        num_blocks=capacity.requests * -(-capacity.tokens_per_request // page) + 2,
        auto_switch_to_flash=False,  # flash attention kernels do not run on a CPU
    )
    hints = WorkloadHints(
        max_prompt_length=capacity.tokens_per_request,
        max_generated_length=0,
        num_requests=capacity.requests,
    )
    generation = GenerationConfig(do_sample=False, num_beams=1, eos_token_id=-1, use_cache=True)
    manager = model.init_continuous_batching(
        generation_config=generation, continuous_batching_config=config, workload_hints=hints
    )
    manager.start()
    _MANAGERS[key] = (capacity, manager)
    return manager


def _collect(manager: Any, pending: set[Any]) -> int:
    """Wait for every request in ``pending`` to finish; the tokens they generated."""
    tokens = 0
    deadline = time.monotonic() + _GENERATE_TIMEOUT_S
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"generate_batch did not finish within {_GENERATE_TIMEOUT_S:.0f} s")
        result = manager.get_result(timeout=1.0)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
            continue
        if result.request_id in pending and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"generate_batch failed a request: {result.error}")
            pending.discard(result.request_id)
            tokens += len(result.generated_tokens)
    return tokens


def _stop_manager(manager: Any) -> None:
    manager.stop(block=True, timeout=_IO_TIMEOUT_S)
    manager.destroy()


def _token_space(model: Any) -> tuple[int, set[int]]:
    """The vocabulary size and the special token ids, which random prompts avoid."""
    cfg = model.config
    special: set[int] = set()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        tok = getattr(cfg, name, None)
        for t in tok if isinstance(tok, (list, tuple)) else [tok]:
            if t is not None:
                special.add(int(t))
    return int(cfg.vocab_size), special


def _random_ids(length: int, vocab: int, special: set[int], generator: Any) -> list[int]:
    import torch

    filler = next(t for t in range(vocab) if t not in special)
    ids = torch.randint(0, vocab, (length,), generator=generator)
    for s in special:
        ids[ids == s] = filler
    return ids.tolist()


@contextlib.contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """Use ``num_threads`` torch intra-op threads for the block (``None``: leave as is)."""
    import torch

    before = torch.get_num_threads()
    if num_threads is not None and num_threads != before:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _prepare_generate(
    model: Any, plens: list[int], wanted: list[int], seed: int, cache: str = "dynamic"
) -> Callable[[], int]:
    """Build the batch once; return a function that runs generate and counts wanted tokens."""
    import torch
    from transformers import GenerationConfig

    cfg = model.config
    vocab, special = _token_space(model)
    pad_id = getattr(cfg, "pad_token_id", None)
    if pad_id is None:
        pad_id = min(special) if special else 0
    filler = next(t for t in range(vocab) if t not in special)

    # generate() fills unset options from model.generation_config (e.g. the checkpoint's
    # eos_token_id or sampling temperature), so replace it: greedy, no EOS, explicit pad.
    gen_cfg = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max(wanted),
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=pad_id,
        use_cache=True,
        **({"cache_implementation": "static"} if cache == "static" else {}),
    )
    model.generation_config = gen_cfg

    # Random prompts of non-special ids, left-padded to the longest, with an attention mask.
    gen = torch.Generator().manual_seed(seed)
    batch_size, width = len(plens), max(plens)
    input_ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, width), dtype=torch.long)
    for i, plen in enumerate(plens):
        ids = torch.randint(0, vocab, (plen,), generator=gen)
        for s in special:
            ids[ids == s] = filler
        input_ids[i, width - plen :] = ids
        attention_mask[i, width - plen :] = 1

    def run_once() -> int:
        model.generation_config = gen_cfg  # several runners may share one cached model
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=gen_cfg)
        generated = int(out.shape[1]) - width
        return sum(min(w, generated) for w in wanted)

    return run_once


@contextlib.contextmanager
def _strict_timing(num_threads: int | None) -> Iterator[None]:
    """A timed transformers run: ``num_threads`` torch threads, inference mode, and any warning (but a
    deprecation) an error, so a degraded fallback never passes as the baseline."""
    import torch

    with (
        torch_threads(num_threads),
        torch.inference_mode(),
        warnings.catch_warnings(),
        _RaiseOnTransformersWarning(),
    ):
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


class _RaiseOnTransformersWarning(logging.Handler):
    """Collects transformers' logger warnings during a block and raises if there were any."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> _RaiseOnTransformersWarning:
        logging.getLogger("transformers").addHandler(self)
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        logging.getLogger("transformers").removeHandler(self)
        if exc_type is None and self.records:
            msgs = "; ".join(r.getMessage() for r in self.records[:3])
            raise RuntimeError(f"transformers logged warnings during generate: {msgs}")
