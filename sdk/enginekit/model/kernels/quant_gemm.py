"""Products of float32 rows with a weight kept as a GGUF file stores it (``QuantGemm``): the native kernels of
``quant_gemm.c`` where the library can be used (:func:`native_quant_gemm`), else a portable equivalent that
dequantizes with gguf-py and calls ``F.linear`` (:func:`quant_gemm` gives whichever applies), so a caller never
branches on availability, only the speed differs.

A weight is passed as ``blocks``: a uint8 tensor ``[out_features, row_bytes]`` holding its rows exactly as the file
stores them, ``row_bytes = in_features / block_size * type_size`` (``gguf.GGML_QUANT_SIZES``). The native kernels
quantize the input rows to int8 (blocks of 32 as llama.cpp does for its dot products, with one scale per
``INPUT_GROUP`` values; the cost in accuracy is in docs/models.md) for the block types at up to 16 rows, except
that on CPUs with AVX-512 BF16 they round the input rows and the dequantized weight to bf16 from ``BF16_MIN_ROWS``
rows on, a prefill's included (the bf16 path), and use float arithmetic otherwise; the portable path computes in float32 throughout.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Literal

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from torch.nn import functional as F

from enginekit.model.kernels import entry_points as entries
from enginekit.model.kernels.library import NativeUnavailable, native_library

logger = logging.getLogger("enginekit.model")

# The types with a native kernel: those people download (F32 goes through the float32 GEMMs).
NATIVE_TYPES = frozenset(
    {
        QType.Q8_0,
        QType.Q4_0,
        QType.Q4_1,
        QType.Q5_0,
        QType.Q5_1,
        QType.Q4_K,
        QType.Q5_K,
        QType.Q6_K,
        QType.F16,
        QType.BF16,
    }
)
Isa = Literal["scalar", "avx2", "avx512_vnni", "avx512_bf16"]
Path = Literal["auto", "int8", "float", "panels", "bf16", "invariant"]
# enginekit_quant_isa in quant_gemm.c; "avx512_bf16": AVX-512 VNNI and BF16 both
ISAS: dict[Isa, int] = {"scalar": 0, "avx2": 1, "avx512_vnni": 2, "avx512_bf16": 3}
INT8_MAX_ROWS = 16  # as in quant_gemm.c: up to this many rows the input is quantized to int8, past it not
BF16_MIN_ROWS = 6  # as in quant_gemm.c: with AVX-512 BF16, the bf16 path from this many rows on
BF16_MIN_ROWS_Q6_K = 8  # as in quant_gemm.c: Q6_K's (its values converted, not looked up)
INPUT_GROUP = 4  # as in quant_gemm.c: input values per int8 scale
ISA_NAMES: dict[int, Isa] = {code: name for name, code in ISAS.items()}
# as in quant_gemm.c; "invariant": one path at every row count (a row's result then never depends on its call's other
# rows): bf16 with AVX-512 BF16, else int8 for the block types and float for F16 and BF16
PATHS: dict[Path, int] = {"auto": 0, "int8": 1, "float": 2, "panels": 3, "bf16": 4, "invariant": 5}


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one stored row of ``in_features`` values of ``qtype`` (``ValueError`` if not whole blocks)."""
    block_size, type_size = _format(qtype)
    if in_features % block_size:
        raise ValueError(
            f"{in_features} input features are not a whole number of {QType(qtype).name} blocks of {block_size}"
        )
    return in_features // block_size * type_size


class QuantGemm:
    """``gemm(x, blocks, qtype, out_features, in_features)``: ``x`` float32 ``[M, K]`` (contiguous) times the stored
    weight ``blocks`` ``[N, row_bytes]`` (uint8) of GGUF type ``qtype``, transposed: float32 ``[M, N]``.

    This class is the portable form (gguf-py's dequantization on every call, then ``F.linear``): correct for every
    type gguf-py reads, on any CPU, and slow. :func:`native_quant_gemm` gives the native one."""

    name = "portable (gguf-py dequantization, then F.linear)"

    def supports(self, qtype: int) -> bool:
        """Whether this object computes with ``qtype`` as stored (the portable form: every type gguf-py reads)."""
        return int(qtype) in gguf.GGML_QUANT_SIZES and QType(qtype) != QType.F32

    def dequantize(
        self, blocks: torch.Tensor, qtype: int, out_features: int, in_features: int
    ) -> torch.Tensor:
        """The weight as float32 ``[out_features, in_features]``, bit-exact with gguf-py's ``dequantize``."""
        _check_blocks(blocks, qtype, out_features, in_features)
        values = gguf.quants.dequantize(blocks.numpy(), QType(qtype))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(
            out_features, in_features
        )

    def __call__(
        self,
        x: torch.Tensor,
        blocks: torch.Tensor,
        qtype: int,
        out_features: int,
        in_features: int,
    ) -> torch.Tensor:
        _check_input(x, in_features)
        return F.linear(x, self.dequantize(blocks, qtype, out_features, in_features))

    def bind(
        self, blocks: torch.Tensor, qtype: int, out_features: int, in_features: int, *, path: Path = "auto"
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``product(x)``: this object's product of ``x`` with one weight, its description looked up once (a
        decode step calls each weight's product once per layer, where the lookups would cost as much as the
        call's checks). ``path``: the native kernels' (``PATHS``); the portable form has one."""
        _check_blocks(blocks, qtype, out_features, in_features)
        return functools.partial(
            self.__call__, blocks=blocks, qtype=qtype, out_features=out_features, in_features=in_features
        )


class NativeQuantGemm(QuantGemm):
    """The native form (``quant_gemm.c``): the stored bytes streamed once per call, no dequantized copy kept.
    Types without a native kernel take the portable path. ``isa`` and ``path`` choose a code path (the fastest
    this CPU has, and by the rows, unless given): for tests and measurements."""

    def __init__(self, lib) -> None:
        self._gemm = entries.QUANT_GEMM.bind(lib)
        self._dequantize = entries.DEQUANTIZE.bind(lib)
        self.best_isa: Isa = ISA_NAMES[lib.enginekit_quant_isa()]
        self.name = f"native ({self.best_isa})"
        self._threads = entries.threads

    def supports(self, qtype: int) -> bool:
        return int(qtype) in NATIVE_TYPES

    def isas(self) -> list[Isa]:
        """The instruction sets this CPU can run, slowest first."""
        return [name for name, code in ISAS.items() if code <= ISAS[self.best_isa]]

    def dequantize(
        self, blocks: torch.Tensor, qtype: int, out_features: int, in_features: int
    ) -> torch.Tensor:
        if not self.supports(qtype):
            return super().dequantize(blocks, qtype, out_features, in_features)
        block_size, type_size = _format(qtype)
        return self._dequantize(
            blocks=blocks,
            qtype=int(qtype),
            N=out_features,
            K=in_features,
            block_size=block_size,
            type_size=type_size,
            threads=self._threads(),
        )

    def bind(
        self, blocks: torch.Tensor, qtype: int, out_features: int, in_features: int, *, path: Path = "auto"
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        if not self.supports(qtype):
            return super().bind(blocks, qtype, out_features, in_features)
        _check_blocks(blocks, qtype, out_features, in_features)
        block_size, type_size = _format(qtype)
        gemm, threads = self._gemm, self._threads
        fixed = {
            "blocks": blocks,
            "qtype": int(qtype),
            "N": out_features,
            "K": in_features,
            "block_size": block_size,
            "type_size": type_size,
            "isa": ISAS[self.best_isa],
            "path": PATHS[path],
        }

        def product(x: torch.Tensor) -> torch.Tensor:  # every argument still checked by the entry point
            return gemm(x=x, threads=threads(), **fixed)

        return product

    def __call__(
        self,
        x: torch.Tensor,
        blocks: torch.Tensor,
        qtype: int,
        out_features: int,
        in_features: int,
        *,
        isa: Isa | None = None,
        path: Path = "auto",
        threads: int | None = None,
    ) -> torch.Tensor:
        if not self.supports(qtype):
            return super().__call__(x, blocks, qtype, out_features, in_features)
        block_size, type_size = _format(qtype)
        return self._gemm(
            x=x,
            blocks=blocks,
            qtype=int(qtype),
            N=out_features,
            K=in_features,
            block_size=block_size,
            type_size=type_size,
            threads=self._threads() if threads is None else threads,
            isa=ISAS[isa or self.best_isa],
            path=PATHS[path],
        )


@functools.cache
def native_quant_gemm() -> NativeQuantGemm | None:
    """The native products with stored GGUF weights, probed against the portable form on the first call in a
    process, or ``None`` (logged why: the library cannot be built or loaded here, or a probe failed). Later calls
    return the same object."""
    lib = native_library()
    if lib is None:
        return None
    gemm = NativeQuantGemm(lib)
    try:
        _probe(gemm)
    except NativeUnavailable as reason:
        logger.warning("native GGUF kernels not used: %s", reason)
        return None
    return gemm


@functools.cache
def quant_gemm() -> QuantGemm:
    """The native products where they can be used here, else the portable form: the same results either way
    (within the native int8 path's rounding, see ``QuantGemm``)."""
    return native_quant_gemm() or QuantGemm()


def int8_error_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """How far the int8 path's product may be from ``x @ weight.T`` (float32 ``[M, N]``): each input value is
    rounded to within half a step of its group of ``INPUT_GROUP``, a step being the group's largest magnitude / 127."""
    steps = x.abs().view(x.shape[0], -1, INPUT_GROUP).amax(-1) / 127  # [M, groups]
    per_value = steps.repeat_interleave(INPUT_GROUP, dim=1) / 2
    return per_value @ weight.abs().T


def bf16_min_rows(qtype: int) -> int:
    """From how many rows the automatic choice takes the bf16 path for ``qtype`` (on CPUs with AVX-512 BF16)."""
    return BF16_MIN_ROWS_Q6_K if qtype == QType.Q6_K else BF16_MIN_ROWS


def bf16_error_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """How far the bf16 path's product may be from ``x @ weight.T`` (float32 ``[M, N]``): each input value and each
    dequantized weight value is rounded to bf16 (8 significant bits: within 2^-8 of its magnitude), and the products
    of the rounded values are summed in float32."""
    return (2.0**-7 + 2.0**-16) * (x.abs() @ weight.abs().T)


def _format(qtype: int) -> tuple[int, int]:
    try:
        return gguf.GGML_QUANT_SIZES[QType(qtype)]
    except (ValueError, KeyError):
        raise ValueError(f"unknown GGUF tensor type {qtype}") from None


def _check_blocks(blocks: torch.Tensor, qtype: int, out_features: int, in_features: int) -> None:
    expected = row_bytes(qtype, in_features)
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8:
        raise TypeError(
            f"the stored weight must be a uint8 tensor, not {getattr(blocks, 'dtype', type(blocks))}"
        )
    if tuple(blocks.shape) != (out_features, expected) or not blocks.is_contiguous():
        raise ValueError(
            f"the stored weight must be a contiguous [{out_features}, {expected}] (uint8 rows of "
            f"{QType(qtype).name}), not {list(blocks.shape)}"
        )


def _check_input(x: torch.Tensor, in_features: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise TypeError(f"the input must be a float32 tensor, not {getattr(x, 'dtype', type(x))}")
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"the input must be [rows, {in_features}], not {list(x.shape)}")


def _probe(gemm: NativeQuantGemm) -> None:
    """Every native type, on every instruction set and path, against the portable form: the dequantized weight
    bit for bit, the product within float32 rounding (within the int8 path's bound for it)."""
    gen = torch.Generator().manual_seed(0)
    portable = QuantGemm()
    for qtype in sorted(NATIVE_TYPES):
        blocks = random_blocks(qtype, 5, 256, gen)
        expected = portable.dequantize(blocks, qtype, 5, 256)
        if not torch.equal(
            gemm.dequantize(blocks, qtype, 5, 256).view(torch.int32), expected.view(torch.int32)
        ):
            raise NativeUnavailable(
                f"its {QType(qtype).name} dequantization differs from gguf-py's on a probe"
            )
        for rows in (1, 5, 17):
            x = torch.randn(rows, 256, generator=gen)
            reference = x.double() @ expected.double().T
            for isa in gemm.isas():
                for path in ("int8", "float", "panels", "bf16"):
                    if (
                        (path == "int8" and qtype in (QType.F16, QType.BF16))
                        or (path == "panels" and isa == "scalar")
                        or (path == "bf16" and isa != "avx512_bf16")
                    ):
                        continue
                    result = gemm(x, blocks, qtype, 5, 256, isa=isa, path=path)
                    slack = 1e-5 * (x.abs() @ expected.abs().T) + 1e-6
                    if path == "int8":
                        slack = slack + int8_error_bound(x, expected)
                    if path == "bf16":
                        slack = slack + bf16_error_bound(x, expected)
                    if not ((result.double() - reference).abs() <= slack).all():
                        raise NativeUnavailable(
                            f"its {QType(qtype).name} product ({isa}, {path} path, {rows} rows) disagrees with the "
                            "dequantized weight's on a probe"
                        )


def random_blocks(
    qtype: int, out_features: int, in_features: int, generator: torch.Generator
) -> torch.Tensor:
    """Stored rows of ``qtype`` with random quantized values and scales (finite, of the size real weights have):
    random bytes, with every float16 field (scales, minimums; every value of F16) and BF16 value overwritten."""
    block_size, type_size = _format(qtype)
    blocks = torch.randint(
        0, 256, (out_features * in_features // block_size, type_size), dtype=torch.uint8, generator=generator
    )
    if qtype == QType.BF16:
        values = torch.randn(blocks.shape[0], generator=generator).to(torch.bfloat16)
        return values.view(torch.uint8).view(out_features, -1).contiguous()
    fields = {
        QType.F16: (0,),
        QType.Q6_K: (208,),
        QType.Q4_1: (0, 2),
        QType.Q5_1: (0, 2),
        QType.Q4_K: (0, 2),
        QType.Q5_K: (0, 2),
    }
    for offset in fields.get(QType(qtype), (0,)):
        scale = 1.0 if qtype == QType.F16 else 0.01
        halves = (torch.randn(blocks.shape[0], generator=generator) * scale).to(torch.float16)
        blocks[:, offset : offset + 2] = halves.view(torch.uint8).view(-1, 2)
    return blocks.view(out_features, -1).contiguous()
