"""The native kernels (the skinny GEMM and the layer operations): correct at every shape, built once per cache,
on torch's thread pool, and a clean fallback to torch's code wherever they cannot be built."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from enginekit import Engine, SamplingParams
from enginekit.model.kernels import library as library_module
from enginekit.model.kernels import native as native_module
from enginekit.model.kernels.library import (
    DISABLE_ENV,
    NativeUnavailable,
    elf_dynamic,
    library_file,
    native_kernels_status,
    native_library,
)
from enginekit.model.kernels.native import MAX_ROWS, _openmp_runtimes, native_layer_ops, native_skinny_gemm
from enginekit.model.layers.linear import SKINNY_MAX_ROWS, linear_kernel

BUILDABLE = (
    sys.platform == "linux"
    and platform.machine() == "x86_64"
    and bool(shutil.which("cc") or shutil.which("gcc"))
    and "avx2" in Path("/proc/cpuinfo").read_text()
)
# A generous hang guard for runs that compile the library: about 20 s of CPU, minutes on a busy machine.
HANG_GUARD_S = 900
needs_native = pytest.mark.skipif(not BUILDABLE, reason="the native kernel is built on x86-64 Linux with gcc")

# Each run in a fresh interpreter: native_skinny_gemm() is built and cached once per process.
PROBE = textwrap.dedent(
    """
    import json, logging, sys, torch
    records = []
    logging.getLogger("enginekit.model").addHandler(type("H", (logging.Handler,), {"emit": lambda s, r: records.append(r.getMessage())})())
    logging.getLogger("enginekit.model").setLevel(logging.INFO)
    from enginekit.model.layers.linear import linear_kernel
    from enginekit.model.kernels.native import native_layer_ops, native_skinny_gemm, _openmp_runtimes
    kernel = native_skinny_gemm()
    print(json.dumps({"native": kernel is not None, "layer_ops": native_layer_ops() is not None, "kernel": linear_kernel(torch.device("cpu"), torch.float32)[0],
                      "runtimes": sorted(_openmp_runtimes()), "log": records}))
    """
)


def _probe(cache: Path, **env: str) -> dict:
    environment = {**os.environ, "ENGINEKIT_CACHE": str(cache), **env}
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=environment,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    """Run the body on ``count`` torch threads (the native kernels' thread count)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _check_against_f_linear(kernel, rows: int, out: int, cols: int, bias: bool, threads: int) -> None:
    """``kernel(x, w, b)`` on seeded inputs of these shapes, on ``threads`` threads, against ``F.linear``."""
    assert kernel is not None
    gen = torch.Generator().manual_seed(rows * out * cols)
    x, w = torch.randn(rows, cols, generator=gen), torch.randn(out, cols, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    with _threads(threads):
        result = kernel(x, w, b)
    assert result.shape == (rows, out) and result.dtype == torch.float32
    torch.testing.assert_close(result, F.linear(x, w, b), rtol=1e-5, atol=1e-5 * cols**0.5)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [*range(1, 14), 16, 31, 64, 127, MAX_ROWS])  # skinny, then every tile
@pytest.mark.parametrize(
    ("out", "cols", "bias"),
    [(960, 576, False), (576, 1536, True), (13, 19, True), (1, 8, False), (9, 3, True)],
)
def test_matches_f_linear(rows: int, out: int, cols: int, bias: bool, threads: int) -> None:
    _check_against_f_linear(native_skinny_gemm(), rows, out, cols, bias, threads)


@needs_native
def test_refuses_more_rows_than_it_takes() -> None:
    kernel = native_skinny_gemm()
    assert kernel is not None
    with pytest.raises(ValueError, match=f"1 to {MAX_ROWS} rows"):
        kernel(torch.randn(MAX_ROWS + 1, 16), torch.randn(4, 16), None)


@needs_native
def test_model_kernel_picks_by_rows_and_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """The skinny GEMM up to SKINNY_MAX_ROWS rows, oneDNN past them on large weights or calls, F.linear for the
    rest; every path agrees with F.linear."""
    from enginekit.model.layers import linear as llama

    name, kernel = linear_kernel(torch.device("cpu"), torch.float32)
    assert name.startswith(f"native skinny GEMM at 1-{SKINNY_MAX_ROWS} rows"), name
    assert "native" not in linear_kernel(torch.device("cpu"), torch.float32, native=False)[0]
    calls: list[str] = []
    skinny, onednn = native_skinny_gemm(), llama._onednn_linear()
    assert onednn is not None
    monkeypatch.setattr(llama, "native_skinny_gemm", lambda: lambda *a: calls.append("skinny") or skinny(*a))
    monkeypatch.setattr(llama, "_onednn_linear", lambda: lambda *a: calls.append("onednn") or onednn(*a))
    kernel = linear_kernel(torch.device("cpu"), torch.float32)[1]
    gen = torch.Generator().manual_seed(0)
    cases = [  # rows, input width, outputs, the kernel expected
        (1, 576, 600, "skinny"),
        (9, 576, 600, "skinny"),
        (SKINNY_MAX_ROWS, 576, 600, "skinny"),
        (SKINNY_MAX_ROWS + 1, 576, 1024, "onednn"),  # a weight of ONEDNN_MIN_WEIGHT_NUMEL or more
        (2048, 64, 600, "onednn"),  # a call of ONEDNN_MIN_WORK or more
        (SKINNY_MAX_ROWS + 1, 64, 600, "torch"),  # small weight, small call
        (0, 576, 600, "torch"),
    ]
    for rows, width, outputs, expected in cases:
        calls.clear()
        x, w = torch.randn(rows, width, generator=gen), torch.randn(outputs, width, generator=gen)
        torch.testing.assert_close(kernel(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-4)
        assert calls == ([] if expected == "torch" else [expected]), (rows, width, calls)
    # Inputs whose rows are not contiguous go to torch's kernels, not to the raw pointer.
    x = torch.randn(576, 9, generator=gen).t()
    calls.clear()
    torch.testing.assert_close(kernel(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert calls == []


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "size"), [(1, 576), (7, 37), (300, 576)])  # 300 rows: the parallel path
def test_rms_norm_matches_torch(rows: int, size: int, threads: int) -> None:
    ops = native_layer_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(rows + size)
    x, w = torch.randn(rows, size + 3, generator=gen)[:, :size], torch.randn(size, generator=gen)
    assert rows == 1 or not x.is_contiguous()  # rows a stride apart
    with _threads(threads):
        result = ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(result, F.rms_norm(x, (size,), w, 1e-5), rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "inter"), [(1, 1536), (5, 13), (64, 1536)])  # 64 rows: the parallel path
def test_silu_mul_matches_torch(rows: int, inter: int, threads: int) -> None:
    ops = native_layer_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 20  # far into both tails of the sigmoid
    with _threads(threads):
        result = ops.silu_mul(gate_up)
    expected = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "inter"), [(1, 1536), (7, 37), (301, 200)])  # 301 x 200: the parallel path
def test_gelu_tanh_mul_matches_torch_and_gives_a_row_the_same_values_whatever_the_rows(
    rows: int, inter: int, threads: int
) -> None:
    ops = native_layer_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 4
    with _threads(threads):
        result = ops.gelu_tanh_mul(gate_up)
        alone = torch.cat([ops.gelu_tanh_mul(gate_up[i : i + 1]) for i in range(rows)])
    expected = F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:]
    torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(result, alone)


ATTENTION_SHAPES = [  # heads, kv heads, head size, block size
    (9, 3, 64, 16),  # the default model's
    (4, 4, 24, 4),  # no grouping; a head size with a vector tail and a rotary half off the vector width
    (8, 1, 80, 1),  # one KV head; a head size past 64 columns; one token per block
    (2, 2, 16, 512),  # blocks longer than the 256 tokens scored at once
    (4, 2, 32, 16),  # the built-in model's: values four vectors wide
    (6, 2, 120, 8),  # values 64 + 32 + 16 + 8 columns wide
]


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), ATTENTION_SHAPES)
def test_rope_write_cache_and_decode_attention_match_torch(
    heads: int, kv_heads: int, dim: int, block_size: int, threads: int
) -> None:
    """The fused rotary embedding and cache write against ``llama.rotate`` and ``index_copy_``; decode attention
    over scattered blocks, contexts of unequal lengths (1 token to several blocks), against SDPA."""
    from enginekit.model.layers.rotary import rotate

    ops = native_layer_ops()
    assert ops is not None and ops.supports(heads, kv_heads, dim)
    gen = torch.Generator().manual_seed(heads * dim + block_size)
    lens = torch.tensor([1, 2, 15, 16, 17, 100, 700, 33] * 3)
    batch, blocks = len(lens), -(-int(lens.max()) // block_size)
    tables = torch.randperm(batch * blocks + 3, generator=gen)[: batch * blocks].view(batch, blocks)
    kv_cache = torch.randn(2, (batch * blocks + 3) * block_size, kv_heads, dim, generator=gen)
    positions = lens - 1
    slots = tables[torch.arange(batch), positions // block_size] * block_size + positions % block_size
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim, generator=gen)
    cos, sin = (torch.randn(batch, 1, dim, generator=gen) for _ in range(2))
    expected_cache = kv_cache.clone()
    expected_qk = rotate(qkv[:, : (heads + kv_heads) * dim].view(batch, -1, dim), cos, sin)
    expected_cache[0].index_copy_(0, slots, expected_qk[:, heads:])
    expected_cache[1].index_copy_(0, slots, qkv[:, (heads + kv_heads) * dim :].view(batch, kv_heads, dim))
    with _threads(threads):
        qk = ops.rope_write_cache(qkv, cos, sin, slots, kv_cache, heads, kv_heads)
        out = ops.paged_attention(qk[:, :heads], kv_cache, tables, lens, block_size, dim**-0.5)
    torch.testing.assert_close(qk, expected_qk, rtol=0, atol=1e-6)
    torch.testing.assert_close(kv_cache, expected_cache, rtol=0, atol=1e-6)
    offsets = torch.arange(block_size).repeat(blocks)
    for seq, length in enumerate(lens.tolist()):
        context = (tables[seq].repeat_interleave(block_size) * block_size + offsets)[:length]
        keys, values = (kv_cache[kv, context].transpose(0, 1) for kv in (0, 1))
        expected = F.scaled_dot_product_attention(
            qk[seq, :heads, None], keys, values, scale=dim**-0.5, enable_gqa=heads != kv_heads
        )[:, 0]
        torch.testing.assert_close(out[seq], expected, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), ATTENTION_SHAPES)
def test_paged_attention_of_prefill_rows_matches_causal_sdpa(
    heads: int, kv_heads: int, dim: int, block_size: int, threads: int
) -> None:
    """Queries that share a table (``table_rows``) and attend to the context up to their own token, as a step's
    prefill chunks do (after a cached context and from the start), with a decode before them and rows of length
    0 left untouched (the rows SDPA attends)."""
    ops = native_layer_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(heads + dim + block_size)
    # sequence 0: a decode at 40 tokens; 1: a chunk of 37 after 300 cached; 2: a fresh prompt of 19; 3: skipped
    contexts, chunk_rows = [40, 337, 19, 5], [1, 37, 19, 5]
    blocks = -(-max(contexts) // block_size)
    tables = torch.randperm(len(contexts) * blocks, generator=gen).view(len(contexts), blocks)
    kv_cache = torch.randn(2, tables.numel() * block_size, kv_heads, dim, generator=gen)
    table_rows = torch.cat([torch.full((n,), i) for i, n in enumerate(chunk_rows)])
    lens = torch.cat([torch.arange(c - n + 1, c + 1) for c, n in zip(contexts, chunk_rows)])
    lens[-chunk_rows[-1] :] = 0
    q = torch.randn(len(lens), heads, dim, generator=gen)
    with _threads(threads):
        out = ops.paged_attention(q, kv_cache, tables, lens, block_size, dim**-0.5, table_rows)
    offsets = torch.arange(block_size).repeat(blocks)
    for row, (table, length) in enumerate(zip(table_rows.tolist(), lens.tolist())):
        if length == 0:
            continue
        context = (tables[table].repeat_interleave(block_size) * block_size + offsets)[:length]
        keys, values = (kv_cache[kv, context].transpose(0, 1) for kv in (0, 1))
        expected = F.scaled_dot_product_attention(
            q[row, :, None], keys, values, scale=dim**-0.5, enable_gqa=heads != kv_heads
        )[:, 0]
        torch.testing.assert_close(out[row], expected, rtol=1e-5, atol=1e-5)


@needs_native
def test_layer_ops_refuse_shapes_past_their_limits() -> None:
    ops = native_layer_ops()
    assert ops is not None
    assert ops.supports(9, 3, 64) and ops.supports(32, 8, 128)
    assert not ops.supports(9, 2, 64)  # query heads not a multiple of the KV heads
    assert not ops.supports(ops.max_group + 1, 1, 8)
    assert not ops.supports(64, 1, ops.max_group_floats // 64 + 1)


@needs_native
@pytest.mark.parametrize("prefill_tokens", [512, 24])
def test_builtin_model_samples_the_same_tokens_with_and_without_native_layer_ops(
    prefill_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mixed steps (decodes and prefill chunks after a cached context), through the engine's own runner; with
    ``NATIVE_PREFILL_TOKENS`` at 24, the chunks that end past it attend through SDPA in the same steps."""
    from enginekit import Engine, SamplingParams
    from enginekit.model import runner

    monkeypatch.setattr(runner, "NATIVE_PREFILL_TOKENS", prefill_tokens)

    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + 11 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    results = []
    for native in (True, False):
        with Engine("builtin", mode="inproc", block_size=4, max_num_batched_tokens=32) as engine:
            model = engine.client.core.runner.model
            if not native:
                model.use_layer_ops(None)
            assert (model.layer_ops is not None) == native
            results.append(
                [out.outputs[0].token_ids for out in engine.generate(prompts, params, progress=False)]
            )
    assert results[0] == results[1]


@needs_native
def test_built_once_per_cache_and_shares_torchs_openmp(tmp_path: Path) -> None:
    first = _probe(tmp_path)
    assert first["native"] and first["layer_ops"], first
    assert first["kernel"].startswith("native skinny GEMM"), first
    assert len(first["runtimes"]) == 1, f"a second OpenMP runtime was loaded: {first['runtimes']}"
    built = list((tmp_path / "native").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so", built
    stamp = built[0].stat().st_mtime_ns
    second = _probe(tmp_path)
    assert second["native"]
    assert [p.stat().st_mtime_ns for p in (tmp_path / "native").iterdir()] == [stamp], (
        "rebuilt on a cache hit"
    )


@needs_native
def test_concurrent_first_builds_publish_one_library(tmp_path: Path) -> None:
    environment = {**os.environ, "ENGINEKIT_CACHE": str(tmp_path)}
    runs = [
        subprocess.Popen([sys.executable, "-c", PROBE], env=environment, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    results = [json.loads(run.communicate(timeout=HANG_GUARD_S)[0].strip().splitlines()[-1]) for run in runs]
    assert all(result["native"] for result in results), results
    assert [p.suffix for p in (tmp_path / "native").iterdir()] == [".so"], "leftover partial builds"


def test_falls_back_without_a_compiler(tmp_path: Path) -> None:
    result = _probe(tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert not result["native"]
    assert not result["layer_ops"]
    assert "native" not in result["kernel"] and result["kernel"].endswith("F.linear"), result
    assert any("native kernels not used" in line and "failed" in line for line in result["log"]), result


def test_can_be_turned_off(tmp_path: Path) -> None:
    result = _probe(tmp_path, ENGINEKIT_NATIVE_KERNELS="0")
    assert not result["native"] and not result["layer_ops"] and not (tmp_path / "native").exists()
    assert any("ENGINEKIT_NATIVE_KERNELS=0" in line for line in result["log"]), result


@needs_native
def test_unwritable_cache_builds_privately(tmp_path: Path) -> None:
    blocked = tmp_path / "cache"
    blocked.mkdir()
    (blocked / "native").write_text("a file where the folder would go")
    result = _probe(blocked)
    assert result["native"], result
    assert any("temporary folder" in line for line in result["log"]), result


def test_source_ships_with_the_package() -> None:
    assert all(source.is_file() for source in native_module.SOURCES)
    assert '"model/kernels/*.c"' in (Path(__file__).parents[1] / "pyproject.toml").read_text()


def test_get_stats_says_whether_the_native_kernels_run_and_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reason is logged at INFO, below the default level: get_stats() is where a user sees it.
    with Engine("builtin", mode="inproc", num_kv_blocks=16) as engine:
        engine.generate("warm", SamplingParams(max_tokens=2))
        assert engine.get_stats()["native_kernels"] == native_kernels_status()
    monkeypatch.setenv(DISABLE_ENV, "0")  # an engine process started now reads it
    with Engine("builtin", mode="mp", num_kv_blocks=16) as engine:
        engine.generate("warm", SamplingParams(max_tokens=2))
        assert engine.get_stats()["native_kernels"] == f"off: {DISABLE_ENV}=0"


# A compiler that notes each call and writes the file SOURCE where it is asked to write the library.
STUB_COMPILER = """#!/bin/sh
echo call >> "{calls}"
while [ "$#" -gt 1 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
cp "{source}" "$out"
"""


@needs_native
@pytest.mark.parametrize("rebuild_loads", [True, False])
def test_a_corrupt_cached_library_is_built_again_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rebuild_loads: bool
) -> None:
    # A cached file that does not load used to turn the kernels off in every process that found it.
    good = native_library()
    assert good is not None
    cache, calls = tmp_path / "cache", tmp_path / "calls"
    monkeypatch.setenv("ENGINEKIT_CACHE", str(cache))
    cached = library_file()
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"\x7fELF\x02\x01 cut short")
    rebuilt = Path(good._name) if rebuild_loads else tmp_path / "also-corrupt.so"
    if not rebuild_loads:
        rebuilt.write_bytes(b"not a library at all")
    compiler = tmp_path / "cc"
    compiler.write_text(STUB_COMPILER.format(calls=calls, source=rebuilt))
    compiler.chmod(0o755)
    result = _probe(cache, CC=str(compiler))
    assert calls.read_text().split() == ["call"], "built again more or less than once"
    assert any("building it again" in line for line in result["log"]), result
    assert result["native"] == rebuild_loads, result
    if rebuild_loads:
        assert cached.read_bytes() == rebuilt.read_bytes()
    else:
        assert any("not a readable shared library" in line for line in result["log"]), result


SECOND_RUNTIME = textwrap.dedent(
    """
    import ctypes, json, sys, torch
    ctypes.CDLL(sys.argv[1])  # a second OpenMP runtime, mapped before the kernels are asked for
    from enginekit.model.kernels.library import native_kernels_status, native_library
    lib = native_library()
    with open("/proc/self/maps") as maps:
        mapped = any("enginekit-native" in line for line in maps)
    print(json.dumps({"native": lib is not None, "mapped": mapped, "status": native_kernels_status()}))
    """
)


@needs_native
def test_a_second_openmp_runtime_is_found_before_the_library_loads(tmp_path: Path) -> None:
    # The check ran after ctypes had loaded the library: its constructors ran beside two thread pools.
    assert native_library() is not None  # built: the child finds it in the cache and would load it
    (runtime,) = _openmp_runtimes()
    second = tmp_path / "libgomp-second.so.1"
    shutil.copy(runtime, second)
    done = subprocess.run(
        [sys.executable, "-c", SECOND_RUNTIME, str(second)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["native"] and "more than one OpenMP runtime" in result["status"], result
    assert not result["mapped"], "the library was loaded before the check"


@needs_native
def test_a_library_that_needs_another_openmp_runtime_is_not_loaded(tmp_path: Path) -> None:
    (runtime,) = _openmp_runtimes()
    other = tmp_path / "libomp.so"  # stands for LLVM's runtime: only its name matters to the loader's choice
    (tmp_path / "empty.c").write_text("int enginekit_other_runtime;\n")
    (tmp_path / "needs.c").write_text("int enginekit_needs_other;\n")
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-Wl,-soname,libomp.so", str(tmp_path / "empty.c"), "-o", str(other)],
        check=True,
    )
    library = tmp_path / "needs-libomp.so"
    subprocess.run(
        [
            "cc",
            "-shared",
            "-fPIC",
            str(tmp_path / "needs.c"),
            "-Wl,--no-as-needed",
            f"-L{tmp_path}",
            "-lomp",
            "-o",
            str(library),
        ],
        check=True,
    )
    assert "libomp.so" in elf_dynamic(library)[0]
    assert elf_dynamic(library_file())[0].count(elf_dynamic(Path(runtime))[1]) == 1  # ours: torch's own
    with pytest.raises(NativeUnavailable, match="second thread pool"):
        library_module._open(library, runtime)
    assert str(library) not in Path("/proc/self/maps").read_text()


@needs_native
@pytest.mark.parametrize(("out", "cols", "bias"), [(960, 576, False), (576, 1536, True), (13, 19, True)])
def test_the_invariant_linear_gives_a_row_the_same_outputs_whatever_the_other_rows(out, cols, bias) -> None:
    # linear_kernel's choice moves from the skinny GEMM to oneDNN or F.linear past 64 rows, which sum otherwise
    _, kernel = linear_kernel(torch.device("cpu"), torch.float32, batch_invariant=True)
    gen = torch.Generator().manual_seed(out)
    x, w = torch.randn(300, cols, generator=gen), torch.randn(out, cols, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    alone = torch.cat([kernel(x[i : i + 1], w, b) for i in range(300)])
    for rows in (2, 8, 9, 64, 65, 128, 129, 300):
        with _threads(2):
            assert torch.equal(kernel(x[:rows], w, b), alone[:rows]), rows
    torch.testing.assert_close(alone, F.linear(x, w, b), rtol=1e-5, atol=1e-5 * cols**0.5)
    assert torch.equal(kernel(x[:6].T.contiguous().T, w, b), alone[:6])  # rows not contiguous: copied first
    assert kernel(x[:0], w, b).shape == (0, out)
