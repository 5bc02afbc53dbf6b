"""The native skinny GEMM: correct at every shape, built once per cache, on torch's thread pool, and a clean
fallback to torch's kernels wherever it cannot be built."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from enginekit.model import skinny_gemm as skinny_module
from enginekit.model.llama import linear_kernel
from enginekit.model.skinny_gemm import MAX_ROWS, native_skinny_gemm

BUILDABLE = (
    sys.platform == "linux"
    and platform.machine() == "x86_64"
    and bool(shutil.which("cc") or shutil.which("gcc"))
    and "avx2" in Path("/proc/cpuinfo").read_text()
)
needs_native = pytest.mark.skipif(not BUILDABLE, reason="the native kernel is built on x86-64 Linux with gcc")

# Each run in a fresh interpreter: native_skinny_gemm() is built and cached once per process.
PROBE = textwrap.dedent(
    """
    import json, logging, sys, torch
    records = []
    logging.getLogger("enginekit.model").addHandler(type("H", (logging.Handler,), {"emit": lambda s, r: records.append(r.getMessage())})())
    logging.getLogger("enginekit.model").setLevel(logging.INFO)
    from enginekit.model.llama import linear_kernel
    from enginekit.model.skinny_gemm import native_skinny_gemm, _openmp_runtimes
    kernel = native_skinny_gemm()
    print(json.dumps({"native": kernel is not None, "kernel": linear_kernel(torch.device("cpu"), torch.float32)[0],
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
        timeout=180,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize(
    ("out", "cols", "bias"),
    [(960, 576, False), (576, 1536, True), (13, 19, True), (1, 8, False), (9, 3, True)],
)
def test_matches_f_linear(rows: int, out: int, cols: int, bias: bool, threads: int) -> None:
    kernel = native_skinny_gemm()
    assert kernel is not None
    gen = torch.Generator().manual_seed(rows * out * cols)
    x, w = torch.randn(rows, cols, generator=gen), torch.randn(out, cols, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        result = kernel(x, w, b)
    finally:
        torch.set_num_threads(previous)
    assert result.shape == (rows, out) and result.dtype == torch.float32
    torch.testing.assert_close(result, F.linear(x, w, b), rtol=1e-5, atol=1e-5 * cols**0.5)


@needs_native
def test_refuses_more_rows_than_it_takes() -> None:
    kernel = native_skinny_gemm()
    assert kernel is not None
    with pytest.raises(ValueError, match="1 to 8 rows"):
        kernel(torch.randn(MAX_ROWS + 1, 16), torch.randn(4, 16), None)


@needs_native
def test_model_kernel_uses_it_for_few_rows_only() -> None:
    name, kernel = linear_kernel(torch.device("cpu"), torch.float32)
    assert name.startswith(f"native skinny GEMM at 1-{MAX_ROWS} rows"), name
    assert "native" not in linear_kernel(torch.device("cpu"), torch.float32, native=False)[0]
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1024, 576, generator=gen)
    for rows in (0, 1, 2, MAX_ROWS, MAX_ROWS + 1, 33):
        x = torch.randn(rows, 576, generator=gen)
        torch.testing.assert_close(kernel(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-4)
    # Inputs that are not contiguous go to torch's kernels, not to the raw pointer.
    x = torch.randn(576, 2, generator=gen).t()
    assert not x.is_contiguous()
    torch.testing.assert_close(kernel(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_native
def test_built_once_per_cache_and_shares_torchs_openmp(tmp_path: Path) -> None:
    first = _probe(tmp_path)
    assert first["native"] and first["kernel"].startswith("native skinny GEMM"), first
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
    results = [json.loads(run.communicate(timeout=180)[0].strip().splitlines()[-1]) for run in runs]
    assert all(result["native"] for result in results), results
    assert [p.suffix for p in (tmp_path / "native").iterdir()] == [".so"], "leftover partial builds"


def test_falls_back_without_a_compiler(tmp_path: Path) -> None:
    result = _probe(tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert not result["native"]
    assert "native" not in result["kernel"] and result["kernel"].endswith("F.linear"), result
    assert any("native skinny-GEMM kernel not used" in line and "failed" in line for line in result["log"]), (
        result
    )


def test_can_be_turned_off(tmp_path: Path) -> None:
    result = _probe(tmp_path, ENGINEKIT_NATIVE_KERNELS="0")
    assert not result["native"] and not (tmp_path / "native").exists()
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
    assert skinny_module.SOURCE.is_file()
    assert '"model/*.c"' in (Path(__file__).parents[1] / "pyproject.toml").read_text()
