"""EngineConfig: every engine option in one frozen, validated struct that crosses to the engine process.

The parallel options (data-parallel ranks, Ray, tensor-parallel size) constrain each other; their checks are
``parallel_options.py``'s, called from ``__post_init__`` with the others.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from typing import Any, Literal, cast, get_args

import msgspec

from enginekit.parallel_options import check_data_parallel, check_tensor_parallel
from enginekit.speculative_options import SpeculativeConfig, parse_speculative_config

__all__ = ["EngineConfig", "EngineMode"]

EngineMode = Literal["inproc", "mp", "async"]
MODEL_NAMES = ("smollm2-135m-instruct", "builtin")
DEFAULT_MODE: EngineMode = "mp"
MODE_ENV_VAR = "ENGINEKIT_MODE"


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """All options of an engine, validated once.

    Parameters
    ----------
    model
        A local Hugging Face folder (``config.json``, ``*.safetensors``, ``tokenizer.json``), a ``.gguf`` file, a
        Hugging Face repo id (``"Qwen/Qwen3-0.6B"``: the local Hugging Face cache, downloaded into it first when
        online; ``HF_HUB_OFFLINE=1`` uses the cache alone), ``"builtin"`` (the tiny test model: seeded random
        weights, byte-level tokenizer) or ``None`` for the default model (SmolLM2-135M-Instruct).
    revision
        The branch, tag or commit of a Hugging Face repo id ``model``; ``None``: ``main``.
    device
        ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``None`` (CUDA when available, else CPU).
    dtype
        ``"float32"``, ``"float16"``, ``"bfloat16"`` or ``None`` (float32 on CPU, bfloat16 on CUDA).
    quantization
        How a GGUF file's quantized weights are held (other models ignore it). ``"auto"``: as the file stores
        them, mapped read-only and shared by every engine process of that file, wherever a kernel computes with
        them (CPU, float32, the native kernels; Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, BF16), and
        dequantized at load to ``dtype`` otherwise (the log says which tensors and why; always on CUDA).
        ``"gguf"``: as stored, or an ``EngineStartupError`` naming the tensor and type that cannot be.
        ``"none"``: every weight dequantized at load (the float32 reference; through the weight cache).
    max_model_len
        Longest prompt plus output in tokens; ``None`` takes the checkpoint's limit (capped by the KV cache).
    block_size
        Tokens per KV-cache block.
    num_kv_blocks
        KV-cache blocks to allocate; ``None`` sizes the cache from ``kv_cache_memory_bytes``.
    kv_cache_memory_bytes
        Memory budget of the KV cache when ``num_kv_blocks`` is ``None``. ``None`` sizes it to the machine: on
        CUDA, ``gpu_memory_utilization`` of the device's memory less what the engine took in a profiling step
        (and what others held when it started); on CPU, 4 GiB, at most a quarter of the memory available to
        the process (``/proc/meminfo``'s ``MemAvailable``, bounded by its memory cgroup's limit), shared out
        between the data-parallel ranks on the machine. Either way no more than ``max_num_seqs`` requests of
        the longest length can fill. ``get_stats()`` reports the size (``kv_cache_bytes``, ``kv_cache_tokens``).
    gpu_memory_utilization
        On CUDA with the cache sized to the machine: the share of the device's memory (0 to 1] this engine
        may take in all (weights, activations and the KV cache); as vLLM's option of that name.
    max_num_seqs
        Most requests in one step.
    max_num_batched_tokens
        Most tokens in one step; longer prompts are prefilled in chunks of at most this many.
    enable_prefix_caching
        Reuse KV blocks of identical full-block prompt prefixes.
    seed
        Seed of the built-in model's weights and of requests sampled without their own seed.
    num_threads
        torch intra-op threads of the engine core. ``None``: in a background process, every usable core
        (shared out between data-parallel ranks); in-process, the process's current torch setting.
        In-process, an explicit value is applied while the engine runs and restored at shutdown.
    adaptive_threads
        An engine on CPU runs up to ``num_threads`` threads and fewer while other processes keep its cores
        busy (checked four times a second), so a busy machine does not stall every op. In-process the count
        applies inside each engine step only: between steps torch runs on the user's setting. ``False``
        keeps exactly ``num_threads``: logprobs then repeat bit for bit from run to run (the thread count
        changes the last bits of attention), but beside a busy process its spinning workers stall every op;
        on a shared machine set ``OMP_WAIT_POLICY=PASSIVE`` as well (in-process, before importing torch).
    startup_timeout
        Seconds to wait for the engine process to report READY.
    shutdown_timeout
        Seconds a shutdown waits for running requests to finish; ``0`` aborts them at once.
    address
        ``None`` for private IPC sockets (a 0700 directory, removed at shutdown), or ``"tcp://HOST:PORT"``
        (``tcp://:PORT`` binds loopback; port ``0`` picks free ports). TCP sockets are protected by a
        per-engine CURVE key pair that only the engine process receives.
    start_method
        How the engine process starts: ``"launcher"`` forks it from a launcher process that imported torch
        once (fast restarts; Linux), ``"spawn"`` starts a fresh interpreter every time.
    log_level
        Engine log level: ``"warning"`` (quiet), ``"info"`` or ``"debug"``.
    fail_at_step
        Test hook: the model runner raises at this step number, as a failing executor would.
    debug_load_delay_s
        Test hook: the engine sleeps this long while loading the model (startup deadlines, orphans mid-load).
    stream_interval
        Engine steps between the messages a streamed request gets (a stream, a live viewer, a background
        generation): its first token comes at once, the next ones every ``stream_interval`` steps, all the
        tokens since the last message together, and its end at once. ``1`` sends every step's token. Larger
        values send that many times fewer messages over a long decode (in ``"mp"`` and ``"async"`` modes, that
        many fewer wake-ups of this process), and the text comes in bursts. A ``generate`` without a viewer is
        not affected: it hears only each request's end.
    max_pending_outputs
        Back-pressure bound: output batches the engine process may hold unsent before it stops stepping.
    data_parallel_size
        Engine core processes, each with its own replica of the model and KV cache (``"mp"`` and ``"async"``
        modes). Rank r runs on ``cuda:r`` on CUDA; on CPU the torch threads are split between the ranks.
    data_parallel_rank
        Start only this rank of ``data_parallel_size`` (external load balancing: one front end per rank, and
        you spread the requests); ``None`` starts every rank behind this front end (internal load balancing).
    data_parallel_load_balancing
        ``"internal"`` (the client sends each request to the rank with the fewest unfinished ones) or
        ``"external"`` (needs ``data_parallel_rank``); ``None`` picks external exactly when a rank is given.
    data_parallel_size_local
        Ranks this front end starts itself (ranks ``0 .. local - 1``, internal load balancing); the others are
        engines started by hand, on other hosts, with ``python -m enginekit.runtime.remote_rank``, that
        connect back over TCP. ``None`` starts every rank here. Needs ``address="tcp://HOST:PORT"`` with a
        fixed port and ``data_parallel_keys``.
    data_parallel_keys
        The file that holds the CURVE keys and ports remote ranks need (mode 0600; copy it to their hosts).
        The front end writes it at startup, keeping the keys of an existing file so that copies stay valid.
    data_parallel_backend
        Where the ranks run: ``"mp"`` (processes this front end starts, plus remote ranks started by hand) or
        ``"ray"`` (every rank a Ray actor in its own placement group, on the cluster this process joined with
        ``ray.init()`` / ``ray.init(address=...)``, else on a local one the engine starts and stops; ``pip
        install 'enginekit[ray]'``). Each rank's bundle holds its whole tensor-parallel group: ``num_threads`` (1 if
        unset) shared out between its ``tensor_parallel_size`` model ranks, at least one CPU each, and on CUDA one
        GPU per model rank; the actor's engine starts its tensor-parallel workers beside it, on that node. The
        ranks join the front end over CURVE-protected TCP, at the host of ``address`` (port ``0`` or
        none: free ports), else loopback on a one-node cluster and this node's address on a larger one.
    tensor_parallel_size
        Model ranks of each engine core (``"mp"`` and ``"async"`` modes): the core's process runs rank 0 and
        starts ``tensor_parallel_size - 1`` worker processes; each rank holds its share of every layer's heads and
        features, of the vocabulary and of the KV cache, and the ranks sum their partial products over
        torch.distributed (gloo on CPU, NCCL on CUDA). The heads, KV heads and intermediate features must split
        evenly; float weights only (a GGUF file is dequantized at load under ``quantization="auto"``). On CPU the
        engine's threads are shared out between its ranks. With ``data_parallel_size`` each data-parallel rank has
        its own ``tensor_parallel_size`` model ranks, locally or in its Ray actor's placement group.
    tensor_parallel_stall_timeout
        Seconds a tensor-parallel worker may hold a step up without any progress before the engine kills it and
        fails with ``EngineDeadError`` naming its rank: it has not reached the collective the other ranks wait in,
        or it is stopped (SIGSTOP, a debugger), and meanwhile neither its collectives nor its CPU time moved and it
        was neither running nor in disk IO. A slow step that computes is never cut short. A worker that exits fails
        the engine at once, whatever this says.
    structured_outputs_backend
        The library that compiles ``StructuredOutputsParams`` and computes their token masks: ``"llguidance"``
        (the default; installed with enginekit) or ``"xgrammar"`` (``pip install 'enginekit[xgrammar]'``). Both
        take the same constraints; see the API reference for how they differ.
    batch_invariant
        A request's tokens and logprobs do not depend on what else is in its batch: each row of a step is computed
        as it would be alone. The products take one path at every row count (with a GGUF's weights as stored: bf16
        on CPUs with AVX-512 BF16, else int8 for the quantized types; float32 weights: the native skinny GEMM in
        calls of up to 128 rows), the LM head's exact top logits are summed row by row, and every query attends
        through the native attention. Off, a step's row count picks the fastest path, which rounds differently,
        so a near tie can go either way in another batch. CPU in float32 with the native kernels only, at most
        two tensor-parallel ranks: elsewhere the start fails saying why. Off by default: on CPUs with AVX-512 BF16
        one request's decode runs the slower bf16 product (0.65-0.72x the tokens/s measured on the default model,
        0.99-1.08x at 16 requests; ``benchmarks/bench_batch_invariant.py``).
    cuda_graphs
        Replay steps from captured CUDA graphs, which removes the per-kernel launch cost of small steps on a
        GPU: decode steps (one graph per padded batch size and context length) and, with the Triton kernels,
        steps with prefill chunks (one per padded token count). With ``enable_lora`` the graphs include the
        adapters' product, so steps with adapters replay them too. On CPU the same padded paths run without graphs
        (slower; for testing them there). Off by default: not yet measured on a GPU.
    cuda_graph_capture_s
        With ``cuda_graphs`` on CUDA: how long the engine may spend capturing graphs as it starts (logged: how
        many shapes in how long): with the Triton kernels the token counts of steps with prefill chunks first,
        then the decode shapes, the shortest contexts first, each at every batch size; the shapes left are
        captured on first use, each making its first step slower. ``0``: every shape on first use (the fastest
        start and restart). Under tensor parallelism every shape is captured on first use.
    async_scheduling
        Overlap the engine's steps, as vLLM's option of that name does: step N+1 is scheduled and its inputs
        prepared while the device runs step N, and its decodes read step N's sampled ids on the device; step N's
        tokens are applied (stops, text, grammars) before step N+1 samples, so outputs are the same as without.
        ``None``: on with CUDA, off on CPU (where the host runs the forward pass and nothing overlaps).
        ``tensor_parallel_size`` above 1 runs without.
    enable_lora
        Serve LoRA adapters (peft folders): ``generate(..., lora_request=LoRARequest(name, id, path))``. Each
        request runs its own adapter or none, mixed in one batch; the adapters' product is added to the
        projections' output, so the base weights (also a GGUF file's, kept as stored) never change.
    max_loras
        Adapters in one step: the slots of the adapter pool on the device. A request of another adapter waits
        while the running requests use ``max_loras`` others; a slot's adapter is swapped for another when
        needed (the least recently used first).
    max_lora_rank
        The largest rank an adapter may have (each slot holds this rank); a larger one is refused, naming it.
    max_cpu_loras
        Adapters kept loaded in host memory (least recently used dropped first, and read again from their folder
        when a request names them); ``None``: ``max_loras``. At least ``max_loras``.
    speculative_config
        Speculative decoding, vLLM's dictionary: ``{"method": "ngram", "num_speculative_tokens": k,
        "prompt_lookup_max": n, "prompt_lookup_min": m}`` (proposals copied from the request's own prompt and
        output: after the latest earlier occurrence of its last n..m tokens) or ``{"method": "draft_model",
        "model": PATH, "num_speculative_tokens": k}`` (a smaller model with the same vocabulary, run greedily).
        Each step verifies a request's proposals in one pass of the model and keeps the longest run the model
        agrees with plus one token of its own: greedy requests get the tokens they would get without, sampled
        ones the same distribution. Defaults: k 8, n 4, m 2. ``"adaptive": True`` (ours, the default): each
        request proposes only as many tokens as its recent acceptance makes worth their rows on this device
        (none in free chat, all k while it copies); ``False``: k whenever the method has them, as vLLM does.
        Steps run serially (``async_scheduling`` off).
    jump_forward
        A structured output's forced text comes without sampling: while its grammar allows one token, that token,
        and the text it forces past them as the backend tokenizes it, verified with the step's proposals (the
        model may tokenize it otherwise). With or without ``speculative_config``; serial steps only (not with
        ``async_scheduling``). ``False``: every token sampled.
    """

    model: str | None = None
    revision: str | None = None
    device: str | None = None
    dtype: Literal["float32", "float16", "bfloat16"] | None = None
    quantization: Literal["auto", "gguf", "none"] = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None
    adaptive_threads: bool = True
    startup_timeout: float = 120.0
    shutdown_timeout: float = 0.0
    address: str | None = None
    start_method: Literal["launcher", "spawn"] = "launcher"
    log_level: Literal["warning", "info", "debug"] = "warning"
    fail_at_step: int | None = None
    debug_load_delay_s: float = 0.0
    stream_interval: int = 1
    max_pending_outputs: int = 64
    data_parallel_size: int = 1
    data_parallel_rank: int | None = None
    data_parallel_load_balancing: Literal["internal", "external"] | None = None
    data_parallel_size_local: int | None = None
    data_parallel_keys: str | None = None
    data_parallel_backend: Literal["mp", "ray"] = "mp"
    tensor_parallel_size: int = 1
    tensor_parallel_stall_timeout: float = 10.0
    cuda_graphs: bool = False
    cuda_graph_capture_s: float = 10.0
    batch_invariant: bool = False
    structured_outputs_backend: Literal["llguidance", "xgrammar"] = "llguidance"
    async_scheduling: bool | None = None
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    speculative_config: dict[str, Any] | None = None
    jump_forward: bool = True

    def __post_init__(self) -> None:
        _require(  # NOTE: an empty path would resolve to the current directory and load whatever lies there
            self.model is None or self.model.strip() != "",
            f"model must not be empty; pass None for the default model or '.' for the current directory, "
            f"got {self.model!r}",
        )
        _require(
            self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
            f"block_size must be a positive power of two, got {self.block_size}",
        )
        _require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 2,
            f"num_kv_blocks must be at least 2, got {self.num_kv_blocks}",
        )
        _require(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            "kv_cache_memory_bytes must be positive",
        )
        _require(
            0 < self.gpu_memory_utilization <= 1,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}",
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 2,
            f"max_model_len must be at least 2, got {self.max_model_len}",
        )
        _require(
            self.num_threads is None or self.num_threads >= 1,
            f"num_threads must be at least 1, got {self.num_threads}",
        )
        _require(self.startup_timeout > 0, "startup_timeout must be positive")
        _require(self.shutdown_timeout >= 0, "shutdown_timeout must be zero or positive")
        _require(self.max_pending_outputs >= 1, "max_pending_outputs must be at least 1")
        _require(self.stream_interval >= 1, f"stream_interval must be at least 1, got {self.stream_interval}")
        _require(  # NOTE: also refuses nan
            self.cuda_graph_capture_s >= 0,
            f"cuda_graph_capture_s must be zero or a positive number of seconds, got {self.cuda_graph_capture_s}",
        )
        if self.address is not None and not self.address.startswith(("tcp://", "ipc://")):
            raise ValueError(f"address must start with tcp:// or ipc://, got {self.address!r}")
        if self.device is not None and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        check_data_parallel(self)
        check_tensor_parallel(self)
        _check_lora(self)
        if self.batch_invariant and (
            (self.device or "cpu").startswith("cuda") or self.dtype not in (None, "float32")
        ):
            raise ValueError(
                "batch_invariant=True runs on CPU in float32 only (its kernels are the native CPU ones), got "
                f"device={self.device!r}, dtype={self.dtype!r}; use device='cpu' and dtype='float32' or None"
            )
        _require(  # NOTE: gloo sums more than two ranks' parts in an order that follows its chunking of the step
            not self.batch_invariant or self.tensor_parallel_size <= 2,
            f"batch_invariant=True holds with at most two tensor-parallel ranks, got tensor_parallel_size="
            f"{self.tensor_parallel_size}: over more, the row-parallel sums' order follows the size of the step",
        )
        _require(
            not (self.async_scheduling and self.tensor_parallel_size > 1),
            "async_scheduling=True cannot be used with tensor_parallel_size > 1 (the other model ranks get each "
            "step's token ids from the host); leave async_scheduling None or False",
        )
        if self.speculative_config is not None:
            parse_speculative_config(self.speculative_config)
            _require(
                not self.async_scheduling,
                "async_scheduling=True cannot be used with speculative_config: a step's proposals follow the "
                "tokens the step before accepted; leave async_scheduling None or False",
            )
        if self.structured_outputs_backend != "llguidance" and importlib.util.find_spec("xgrammar") is None:
            raise ImportError(
                "structured_outputs_backend='xgrammar' needs the xgrammar package, which is not installed: "
                "pip install 'enginekit[xgrammar]', or leave the default backend, 'llguidance'"
            )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` checked, with its defaults filled in (``None``: no speculative decoding)."""
        if self.speculative_config is None:
            return None
        return parse_speculative_config(self.speculative_config)

    @property
    def num_cpu_loras(self) -> int:
        """LoRA adapters kept in host memory: ``max_cpu_loras``, or ``max_loras`` when unset."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def data_parallel_ranks(self) -> list[int]:
        """The ranks this front end starts: all of them, or just ``data_parallel_rank``."""
        if self.data_parallel_rank is not None:
            return [self.data_parallel_rank]
        return list(range(self.data_parallel_size))

    @property
    def data_parallel_remote_ranks(self) -> list[int]:
        """The ranks that connect from elsewhere (``data_parallel_size_local`` and up); the rest start here."""
        if self.data_parallel_size_local is None:
            return []
        return list(range(self.data_parallel_size_local, self.data_parallel_size))

    @classmethod
    def from_options(cls, model: str | os.PathLike[str] | None = None, **options: Any) -> EngineConfig:
        """Build a config from keyword options; an unknown option raises ``TypeError`` naming the closest."""
        valid = cls.__struct_fields__
        for name in options:
            if name not in valid:
                close = difflib.get_close_matches(name, valid, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"unknown engine option {name!r}{hint}")
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise TypeError(
                "model must be a local Hugging Face folder, a .gguf file, a Hugging Face repo id, a model name "
                f"({', '.join(map(repr, MODEL_NAMES))}) or None for the default, got {model!r} "
                f"({type(model).__name__})"
            )
        model_path = os.fspath(model) if model is not None else None
        try:
            return msgspec.convert({"model": model_path, **options}, cls)
        except msgspec.ValidationError as error:
            raise _option_error(cls, error) from None

    def replace(self, **options: Any) -> EngineConfig:
        """Return a copy with some options changed (validated like ``from_options``)."""
        current = msgspec.structs.asdict(self)
        current.update(options)
        model = current.pop("model")
        return EngineConfig.from_options(model, **current)


def resolve_mode(mode: str | None) -> EngineMode:
    """The mode argument, else ``ENGINEKIT_MODE``, else the default ``"mp"``; validated."""
    chosen = mode if mode is not None else os.environ.get(MODE_ENV_VAR) or DEFAULT_MODE
    valid = get_args(EngineMode)
    if chosen not in valid:
        source = "mode" if mode is not None else MODE_ENV_VAR
        raise ValueError(f"{source} must be one of {', '.join(map(repr, valid))}, got {chosen!r}")
    return cast(EngineMode, chosen)  # one of its values: checked above


def _option_error(cls: type, error: msgspec.ValidationError) -> Exception:
    """Turn msgspec's message into one that names the option and its valid values."""
    message = str(error)
    name = message.rpartition("$.")[2].rstrip("`") if "$." in message else ""
    annotation = cls.__annotations__.get(name)
    if annotation is None:  # raised by __post_init__: already a full sentence
        return ValueError(message.split(" - at `")[0])
    choices = _choices(annotation)
    if choices:
        got = message.split(" - at `")[0].removeprefix("Invalid enum value ")
        return ValueError(f"engine option {name} must be one of {choices}, got {got}")
    expected = message.split(" - at `")[0].replace("Expected `", "").split("`, got `")
    got = expected[1].rstrip("`") if len(expected) == 2 else "another type"
    return TypeError(f"engine option {name} must be {expected[0].replace(' | null', ' or None')}, got {got}")


def _choices(annotation: str) -> str:
    """``"'a', 'b' or None"`` for a Literal annotation (as a string, with postponed evaluation)."""
    if not annotation.startswith("Literal["):
        return ""
    inner, _, rest = annotation[len("Literal[") :].partition("]")
    values = [part.strip() for part in inner.split(",")]
    if "None" in rest:
        values.append("None")
    return ", ".join(values[:-1]) + f" or {values[-1]}"


def _check_lora(config: EngineConfig) -> None:
    _require(config.max_loras >= 1, f"max_loras must be at least 1, got {config.max_loras}")
    _require(config.max_lora_rank >= 1, f"max_lora_rank must be at least 1, got {config.max_lora_rank}")
    _require(
        config.max_cpu_loras is None or config.max_cpu_loras >= config.max_loras,
        f"max_cpu_loras must be at least max_loras ({config.max_loras}), got {config.max_cpu_loras}",
    )
    _require(  # NOTE: an adapter's rows are multiplied together, so their sums' shape follows how many share it
        not (config.enable_lora and config.batch_invariant),
        "enable_lora=True cannot be used with batch_invariant=True: the adapters' products take their rows "
        "together, so a row's rounding would depend on the requests beside it; turn one of them off",
    )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
