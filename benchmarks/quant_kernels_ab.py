"""The GGUF kernels of two source trees side by side (measured by hand, not part of ``run.py``): each tree's C files
built into a library of their own, both called directly (ctypes, no Python checks) on the default model's shapes,
alternating, best of seven rounds; the results of the two are checked to agree (within 1e-3 of the largest output
on the same path, 1e-2 between different paths, which round differently). The same tree can be given twice with
two paths (``--before . --after-path bf16``).

Run: ``python benchmarks/quant_kernels_ab.py --before /path/to/other/checkout [--isa avx512_vnni] [--path int8]
[--after-isa avx512_bf16] [--after-path auto] [--quick]``.
Prints one line per shape, rows and threads: microseconds per call of each tree and before / after.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as QType

from enginekit.model.kernels.library import FLAGS, SOURCES
from enginekit.model.kernels.quant_gemm import ISAS, PATHS, random_blocks

HERE = Path(__file__).resolve().parents[1]
SHAPES = [  # (type, out, in): the default model's projections (SmolLM2-135M Q4_1, Q8_0 head)
    (QType.Q4_1, 3072, 576),
    (QType.Q4_1, 960, 576),
    (QType.Q4_1, 576, 576),
    (QType.Q4_1, 576, 1536),
    (QType.Q8_0, 49152, 576),
]
ONE_ROW = [(qtype, 2048, 2048) for qtype in (QType.Q4_K, QType.Q6_K, QType.Q4_0, QType.Q5_1, QType.Q8_0)]


def build(tree: Path, out: Path) -> ctypes.CDLL:
    """The library of ``tree``'s kernels (the engine's sources that ``tree`` has, the engine's flags)."""
    folder = tree / "sdk/enginekit/model/kernels"
    sources = [str(folder / source.name) for source in SOURCES if (folder / source.name).exists()]
    subprocess.run(["gcc", *FLAGS, *sources, "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.enginekit_quant_gemm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.enginekit_quant_gemm.argtypes += [ctypes.c_long] * 3 + [ctypes.c_int] * 3
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", type=Path, required=True, help="the other checkout (its repository root)")
    parser.add_argument("--after", type=Path, default=HERE, help="this checkout unless given")
    parser.add_argument("--isa", choices=list(ISAS), default="avx512_vnni")
    parser.add_argument("--path", choices=list(PATHS), default="int8")
    parser.add_argument(
        "--after-isa", choices=list(ISAS), help="the after tree's instruction set (else --isa)"
    )
    parser.add_argument("--after-path", choices=list(PATHS), help="the after tree's path (else --path)")
    parser.add_argument("--quick", action="store_true", help="1 and 8 rows only")
    args = parser.parse_args()
    modes = {
        "before": (ISAS[args.isa], PATHS[args.path]),
        "after": (ISAS[args.after_isa or args.isa], PATHS[args.after_path or args.path]),
    }
    tolerance = 1e-3 if modes["before"] == modes["after"] else 1e-2
    _ = torch.zeros(2) @ torch.zeros(2)  # torch's OpenMP runtime first: the libraries link the same one
    with tempfile.TemporaryDirectory() as folder:
        libs = {
            name: build(tree, Path(folder) / f"{name}.so")
            for name, tree in (("before", args.before), ("after", args.after))
        }
        rows = (1, 8) if args.quick else (1, 4, 8, 16)
        cases = [(*shape, m) for shape in SHAPES for m in rows] + [(*shape, 1) for shape in ONE_ROW]
        gen = torch.Generator().manual_seed(0)
        print(
            f"{'type':5s} {'out':>6s} {'in':>5s} {'rows':>4s} {'thr':>3s} {'before us':>10s} {'after us':>9s}  ratio"
        )
        for qtype, n, k, m in cases:
            weight = random_blocks(qtype, n, k, gen)
            x = torch.randn(m, k, generator=gen)
            reps = max(5, int(2e5 / (n * k / 32)))
            for threads in (1, 2):
                outputs = {name: torch.empty(m, n) for name in libs}
                best = {name: float("inf") for name in libs}
                for _ in range(7):
                    for name, lib in libs.items():
                        call = (
                            x.data_ptr(),
                            weight.data_ptr(),
                            int(qtype),
                            outputs[name].data_ptr(),
                            m,
                            n,
                            k,
                        )
                        call += (threads, *modes[name])
                        start = time.perf_counter()
                        for _ in range(reps):
                            assert lib.enginekit_quant_gemm(*call) == 0
                        best[name] = min(best[name], (time.perf_counter() - start) / reps)
                scale = outputs["before"].abs().max().item()
                assert (outputs["before"] - outputs["after"]).abs().max().item() <= tolerance * scale + 1e-5
                print(
                    f"{qtype.name:5s} {n:6d} {k:5d} {m:4d} {threads:3d} {1e6 * best['before']:10.1f} "
                    f"{1e6 * best['after']:9.1f}  {best['before'] / best['after']:.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
