"""What the benchmark sections share: the two models, workloads, timed engine runs and interleaving.

Every comparison in the suite is made between alternatives measured *interleaved*, sample by sample
(``interleave``), so that a burst of background load on a shared machine hits all of them alike; ratios
are the median of the per-repeat ratios (``paired_ratio``).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import importlib.util
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .baselines import torch_threads
from .stats import Summary, summarize

REPO_ROOT = Path(__file__).resolve().parent.parent

LLAMA_SIZES = dict(
    hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=688, vocab_size=4096
)
LLAMA_MAX_POSITIONS = 8192
_CALL_TIMEOUT_S = 600.0  # a benchmark run that takes longer than this is hung, not slow


# --------------------------------------------------------------------------------------
# Run context
# --------------------------------------------------------------------------------------


@dataclass
class Context:
    """One suite run: a scratch folder, the torch thread count, and the models built in it on demand."""

    workdir: Path
    threads: int  # torch's thread count in this process when the run started
    cache: dict[str, Any] = field(default_factory=dict)  # figures one section measures and others reuse
    _models: dict[str, ModelSpec] = field(default_factory=dict)

    def models(self) -> list[ModelSpec]:
        """The two tiny models: the built-in one and a random Llama folder."""
        return [self.model("builtin"), self.model("llama")]

    def model(self, key: str) -> ModelSpec:
        if key not in self._models:
            build = {
                "builtin": _builtin_model,
                "llama": _llama_model,
                "qwen3": _qwen3_model,
                "smollm2": _smollm2_model,
            }[key]
            self._models[key] = build(self.workdir / key)
        return self._models[key]


_SESSION: list[Context] = []  # the run's one context, made on first use


def session() -> Context:
    """The run's shared context (made on first use, its folder removed at exit): every section's models are
    built once per run."""
    if not _SESSION:
        import torch

        workdir = Path(tempfile.mkdtemp(prefix="enginekit-bench-"))
        atexit.register(shutil.rmtree, workdir, True)
        _SESSION.append(Context(workdir, torch.get_num_threads()))
    return _SESSION[0]


def log(message: str) -> None:
    """A progress line on stderr (the page and the JSON are the results)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ModelSpec:
    """A model as the engine loads it (``engine_model``) and as transformers loads it (``hf_path``)."""

    key: str
    label: str
    engine_model: str  # what Engine(...) takes: a name ("builtin") or a path
    hf_path: str
    config: Any  # enginekit ModelConfig
    token_range: tuple[int, int]  # prompt token ids are drawn from [lo, hi): no special tokens

    def random_prompt(self, length: int, rng: random.Random) -> list[int]:
        lo, hi = self.token_range
        return [rng.randrange(lo, hi) for _ in range(length)]


def _builtin_model(folder: Path) -> ModelSpec:
    """The built-in model, plus the same weights written as a Hugging Face Llama folder for transformers."""
    from enginekit.model.builtin import BUILTIN_CONFIG, builtin_weights
    from enginekit.model.text.tokenizer import ByteTokenizer

    config = BUILTIN_CONFIG
    weights = builtin_weights(config, 0)  # seed 0 is the engine's default seed
    _save_hf_llama(folder, config, weights)
    return ModelSpec(
        key="builtin",
        label="built-in tiny model (hidden 128, 4 layers, 4 heads, 2 KV heads, vocab 259)",
        engine_model="builtin",
        hf_path=str(folder),
        config=config,
        token_range=(ByteTokenizer.NUM_SPECIAL, ByteTokenizer.vocab_size),
    )


def _save_hf_llama(folder: Path, config: Any, weights: dict) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_ids[0],
        pad_token_id=0,
        dtype="float32",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config)
    model.load_state_dict(weights, strict=True, assign=True)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)


def _tiny_model(folder: Path, architecture: str, label: str) -> ModelSpec:
    """A tiny random checkpoint of ``architecture`` (tests/hf_checkpoints.py) of the tiny Llama's sizes."""
    from enginekit.model.formats.hf import read_hf_config

    checkpoints = _import_file("hf_checkpoints", REPO_ROOT / "tests" / "hf_checkpoints.py")
    checkpoints.build_checkpoint(
        folder, architecture, max_position_embeddings=LLAMA_MAX_POSITIONS, seed=0, **LLAMA_SIZES
    )
    config = read_hf_config(folder)
    return ModelSpec(
        key=architecture,
        label=label,
        engine_model=str(folder),
        hf_path=str(folder),
        config=config,
        token_range=(2, config.vocab_size),  # 0 and 1 are <s> and </s>
    )


def _llama_model(folder: Path) -> ModelSpec:
    return _tiny_model(
        folder, "llama", "tiny random Llama (hidden 256, 4 layers, 8 heads, 4 KV heads, vocab 4096)"
    )


def _qwen3_model(folder: Path) -> ModelSpec:
    """A second architecture: a tiny random Qwen3 (q/k norms) of the tiny Llama's sizes."""
    label = "tiny random Qwen3 (hidden 256, 4 layers, 8 heads, 4 KV heads, q/k norms, vocab 4096)"
    return _tiny_model(folder, "qwen3", label)


def _smollm2_model(folder: Path) -> ModelSpec:
    """The default real model: SmolLM2-135M-Instruct's Q4_1 GGUF, which the engine keeps as stored by default
    (``quantization="auto"``); transformers loads the same file dequantized to float32."""
    from enginekit.model.formats.gguf import read_gguf_config
    from enginekit.model.formats.source import DEFAULT_MODEL, default_model_file

    path = default_model_file()
    config = read_gguf_config(path)
    return ModelSpec(
        key="smollm2",
        label="SmolLM2-135M-Instruct (Q4_1 GGUF; hidden 576, 30 layers, 9 heads, 3 KV heads, vocab 49152)",
        engine_model=DEFAULT_MODEL,
        hf_path=str(path),
        config=config,
        token_range=(17, config.vocab_size),  # the first 17 ids are special tokens
    )


def _import_file(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """One batch of requests: prompt and output length per request (greedy, EOS ignored)."""

    name: str
    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.prompt_lens)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> str:
        if len(set(self.prompt_lens)) == 1 and len(set(self.output_lens)) == 1:
            return f"prompt {self.prompt_lens[0]}, output {self.output_lens[0]}"
        return (
            f"prompt {min(self.prompt_lens)}-{max(self.prompt_lens)}, "
            f"output {min(self.output_lens)}-{max(self.output_lens)}"
        )


def equal_workload(size: int, prompt_len: int, output_len: int) -> Workload:
    return Workload("equal", (prompt_len,) * size, (output_len,) * size)


def mixed_workload(
    size: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int
) -> Workload:
    """Prompt and output lengths drawn uniformly (seeded) from the inclusive ranges."""
    rng = random.Random(seed)
    prompts = tuple(rng.randint(*prompt_range) for _ in range(size))
    outputs = tuple(rng.randint(*output_range) for _ in range(size))
    return Workload("mixed", prompts, outputs)


def poisson_arrivals(size: int, window_s: float, seed: int) -> list[float]:
    """Arrival offsets (seconds) of a seeded Poisson process, scaled so the last arrives at ``window_s``."""
    rng = random.Random(seed)
    times = [0.0]
    for _ in range(size - 1):
        times.append(times[-1] + rng.expovariate(1.0))
    scale = window_s / times[-1] if times[-1] > 0 else 0.0
    return [t * scale for t in times]


def greedy(max_tokens: int) -> Any:
    from enginekit import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def forward_flops(config: Any, prompt_len: int, output_len: int) -> float:
    """Useful forward FLOPs to generate ``output_len`` tokens after a ``prompt_len`` prompt.

    Counts every multiply-add as 2 FLOPs: the layers' projections for each token that goes through the
    model (the prompt and all outputs but the last), attention against the causal context of each such
    token, and the LM head for each sampled token. Padding and recomputation are not useful work.
    """
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_layers
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    per_token = 2.0 * layers * (hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * inter)
    num_forward = prompt_len + output_len - 1
    # Token at position t attends to t + 1 positions: QK^T and AV, 2 FLOPs per multiply-add each.
    attended = num_forward * (num_forward + 1) / 2
    attention = 2.0 * 2.0 * layers * q_size * attended
    lm_head = 2.0 * hidden * config.vocab_size * output_len
    return per_token * num_forward + attention + lm_head


def workload_flops(config: Any, workload: Workload) -> float:
    return sum(forward_flops(config, p, o) for p, o in zip(workload.prompt_lens, workload.output_lens))


def kv_blocks_for(workload: Workload, block_size: int = 16, slack: int = 64) -> int:
    """KV blocks that hold the whole workload at once (no preemption), plus some slack."""
    return (
        sum(-(-(p + o) // block_size) + 1 for p, o in zip(workload.prompt_lens, workload.output_lens)) + slack
    )


# --------------------------------------------------------------------------------------
# Timed engine runs
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One timed run: tokens generated, wall time, and the CPU time the caller's threads used meanwhile (see
    ``front_end_cpu_s``)."""

    tokens: int
    elapsed_s: float
    cpu_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s


def make_engine(spec: ModelSpec, mode: str, **options: Any) -> Any:
    """An engine on ``spec``'s model; in-process engines leave torch's thread count as it was."""
    from enginekit import Engine

    # NOTE: an in-process engine with num_threads sets torch's process-wide thread count and never
    # restores it; keep that from leaking into whatever is measured next.
    with torch_threads(None):
        return Engine(spec.engine_model, mode=mode, **options)


def engine_batch_runner(
    engine: Any,
    spec: ModelSpec,
    workload: Workload,
    *,
    threads: int | None = None,
    seed: int = 0,
    deltas: bool = False,
) -> Callable[[], Run]:
    """A function that submits the whole workload at once, waits for all of it and returns a Run.

    Every call uses fresh random prompts (built before the clock starts), so no run hits the prefix cache
    filled by an earlier one. ``threads`` sets this process's torch threads during the call (for in-process
    engines, whose thread count is process-wide). ``deltas``: the engine sends every request a delta per step,
    as a stream or a viewer gets them, instead of ``generate``'s one output per request end.
    """
    rng = random.Random(seed)
    params = [greedy(n) for n in workload.output_lens]
    expected = workload.num_output_tokens

    def run() -> Run:
        prompts = [{"prompt_token_ids": spec.random_prompt(n, rng)} for n in workload.prompt_lens]
        cpu_start = front_end_cpu_s(engine)
        with torch_threads(threads):
            if engine.mode == "async":
                outputs, elapsed = asyncio.run(_timed_agenerate(engine, prompts, params, deltas))
            elif deltas:
                start = time.perf_counter()
                outputs = engine._router.collect(*_submit_for_deltas(engine, prompts, params))
                elapsed = time.perf_counter() - start
            else:
                start = time.perf_counter()
                outputs = engine.generate(prompts, params, progress=False)
                elapsed = time.perf_counter() - start
        return Run(_count_tokens(outputs, expected), elapsed, front_end_cpu_s(engine) - cpu_start)

    return run


def front_end_cpu_s(engine: Any) -> float:
    """CPU seconds so far of the threads that serve an engine's caller: this thread (which runs the asyncio loop
    in async mode) and, in mp mode, the client's receive thread. Not the process's CPU time: after an
    in-process engine's run, its OpenMP workers spin on for some milliseconds, and that would count."""
    serving = [threading.current_thread()]
    receive_thread = getattr(getattr(engine.client, "receiver", None), "_thread", None)
    if receive_thread is not None:
        serving.append(receive_thread)
    return sum(time.clock_gettime(time.pthread_getcpuclockid(thread.ident)) for thread in serving)


async def _timed_agenerate(engine: Any, prompts: list, params: list, deltas: bool) -> tuple[list, float]:
    start = time.perf_counter()
    if deltas:
        outputs = await engine._router.collect_async(*_submit_for_deltas(engine, prompts, params))
    else:
        outputs = await engine.agenerate(prompts, params, progress=False)
    return outputs, time.perf_counter() - start


def _submit_for_deltas(engine: Any, prompts: list, params: list) -> tuple[list[Any], Any]:
    """The requests' states and a watcher that shows nothing, for the output router to collect."""
    # NOTE: the facade's internals: what generate does, with every request sent a delta per step (as for a
    # viewer, without drawing one).
    from enginekit.notebook.watch import NoWatcher

    return engine._submit(prompts, params, final_only=False), NoWatcher()


def engine_staggered_runner(
    engine: Any,
    spec: ModelSpec,
    workload: Workload,
    arrivals: Sequence[float],
    *,
    threads: int | None = None,
    seed: int = 0,
    callers: str = "driver",
) -> Callable[[], Run]:
    """Like ``engine_batch_runner``, but request ``i`` is submitted ``arrivals[i]`` seconds after the start.

    ``callers`` says who submits and waits: ``"driver"`` (one thread submits each request at its arrival
    and pulls outputs in between, as ``generate`` does; in-process engines step on each pull),
    ``"threads"`` (one thread per request calling ``generate``) or ``"tasks"`` (one asyncio task per
    request awaiting ``agenerate``). The Run's time is from the start to the last completion.
    """
    rng = random.Random(seed)
    params = [greedy(n) for n in workload.output_lens]
    expected = workload.num_output_tokens
    drive = {"driver": _staggered_driver, "threads": _staggered_threads, "tasks": _staggered_tasks}[callers]

    def run() -> Run:
        prompts = [{"prompt_token_ids": spec.random_prompt(n, rng)} for n in workload.prompt_lens]
        with torch_threads(threads):
            outputs, elapsed = drive(engine, prompts, params, arrivals)
        return Run(_count_tokens(outputs, expected), elapsed)

    return run


def _staggered_driver(
    engine: Any, prompts: list, params: list, arrivals: Sequence[float]
) -> tuple[list, float]:
    # NOTE: uses the facade's internals (_submit, then the output router's _pump: exactly what generate does,
    # with new submissions between steps). engine.stream cannot drive several requests from one thread: a stream
    # whose request another stream's pump finished ends without yielding its final output.
    if engine.mode == "async":
        raise ValueError("callers='driver' needs a sync mode; use 'tasks' in async mode")
    pending = collections.deque(sorted(range(len(prompts)), key=lambda i: arrivals[i]))
    states: list[Any] = [None] * len(prompts)
    unfinished: collections.deque[Any] = collections.deque()
    start = time.perf_counter()
    deadline = start + _CALL_TIMEOUT_S
    while pending or unfinished:
        now = time.perf_counter()
        if now > deadline:
            raise TimeoutError(f"staggered requests did not finish within {_CALL_TIMEOUT_S:.0f}s")
        while pending and start + arrivals[pending[0]] <= now:
            index = pending.popleft()
            (states[index],) = engine._submit(prompts[index], params[index], "generate", final_only=True)
            unfinished.append(states[index])
        while unfinished and unfinished[0].finished:
            unfinished.popleft()
        if unfinished:  # route a batch, or wait for one (mp) until the oldest request changes
            engine._router._pump(unfinished[0], unfinished[0].version)
        elif pending:
            time.sleep(min(0.0005, max(0.0, start + arrivals[pending[0]] - now)))
    return [state.output for state in states], time.perf_counter() - start


def _staggered_threads(
    engine: Any, prompts: list, params: list, arrivals: Sequence[float]
) -> tuple[list, float]:
    outputs: list[Any] = [None] * len(prompts)
    errors: list[BaseException] = []
    start = time.perf_counter() + 0.05  # every thread is started before the first arrival

    def caller(index: int) -> None:
        delay = start + arrivals[index] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        try:
            (outputs[index],) = engine.generate(prompts[index], params[index], progress=False)
        except BaseException as error:
            errors.append(error)

    callers = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(len(prompts))]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join(timeout=_CALL_TIMEOUT_S)
        if thread.is_alive():
            raise TimeoutError(f"a staggered request did not finish within {_CALL_TIMEOUT_S:.0f}s")
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return outputs, elapsed


def _staggered_tasks(
    engine: Any, prompts: list, params: list, arrivals: Sequence[float]
) -> tuple[list, float]:
    return asyncio.run(_staggered_tasks_async(engine, prompts, params, arrivals))


async def _staggered_tasks_async(
    engine: Any, prompts: list, params: list, arrivals: Sequence[float]
) -> tuple[list, float]:
    start = time.perf_counter()

    async def one(index: int) -> Any:
        delay = start + arrivals[index] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        (output,) = await engine.agenerate(prompts[index], params[index], progress=False)
        return output

    gathered = asyncio.gather(*(one(i) for i in range(len(prompts))))
    outputs = await asyncio.wait_for(gathered, _CALL_TIMEOUT_S)
    return outputs, time.perf_counter() - start


def _count_tokens(outputs: list, expected: int) -> int:
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    if tokens != expected:
        raise RuntimeError(f"the engine generated {tokens} tokens, expected {expected} (greedy, ignore_eos)")
    return tokens


# --------------------------------------------------------------------------------------
# Interleaving and ratios
# --------------------------------------------------------------------------------------


def interleave(
    runners: dict[str, Callable[[], Any]], *, repeats: int, warmup: int = 1
) -> dict[str, list[Any]]:
    """Call every runner ``warmup`` times untimed, then ``repeats`` rounds of one call each.

    The order within a round rotates, so no runner always goes first (or always follows the same one).
    """
    names = list(runners)
    for _ in range(warmup):
        for name in names:
            runners[name]()
    samples: dict[str, list[Any]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(runners[name]())
    return samples


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> Summary:
    """Summary of the per-round ratios ``numerator[i] / denominator[i]`` of two interleaved series."""
    if len(numerator) != len(denominator):
        raise ValueError("paired series must have the same length")
    return summarize(n / d for n, d in zip(numerator, denominator))


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> str:
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "n/a"
    return f"{one:.2f} (1 min), {five:.2f} (5 min)"


@contextlib.contextmanager
def engines_up(
    spec: ModelSpec, variants: dict[str, dict[str, Any]], workload: Workload
) -> Iterator[dict[str, Any]]:
    """One engine per variant (``{name: {"mode": ..., **options}}``) on ``spec``'s model, with KV blocks for
    the whole ``workload`` at once; all of them shut down when the block ends."""
    engines: dict[str, Any] = {}
    try:
        for name, options in variants.items():
            options = dict(options)
            options.setdefault("num_kv_blocks", kv_blocks_for(workload))
            engines[name] = make_engine(spec, options.pop("mode"), **options)
        yield engines
    finally:
        for engine in engines.values():
            engine.shutdown()


def rate_runners(
    engines: dict[str, Any],
    spec: ModelSpec,
    workload: Workload,
    *,
    seed: int = 0,
    inproc_threads: int | None = None,
    deltas: bool = False,
) -> dict[str, Callable[[], float]]:
    """For each engine, a function that runs ``workload`` once (fresh prompts) and returns its tokens/s;
    in-process engines run under ``inproc_threads`` torch threads."""
    runners = {}
    for i, (name, engine) in enumerate(engines.items()):
        threads = inproc_threads if engine.mode == "inproc" else None
        run = engine_batch_runner(engine, spec, workload, threads=threads, seed=seed + i, deltas=deltas)
        runners[name] = lambda run=run: run().tokens_per_s
    return runners
