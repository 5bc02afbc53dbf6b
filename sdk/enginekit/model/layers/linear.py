"""Linear layers and the CPU kernel that runs them (``linear_kernel``): the native skinny GEMM, oneDNN or ``F.linear``;
a layer whose weight is kept as a GGUF file stores it runs that weight's own product instead
(``quant_linear.QuantizedWeight``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from enginekit.model.kernels.native import MAX_ROWS, native_skinny_gemm
from enginekit.model.layers.quant_linear import QuantizedWeight

logger = logging.getLogger("enginekit.model")
LinearKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# adds the LoRA adapters' product of the input (first) to the layer's output (second), in place (model/lora/)
LinearAdapter = Callable[[torch.Tensor, torch.Tensor], None]


class Linear(nn.Linear):
    """A linear layer that skips random initialisation (its weights always come from a loader) and runs the
    model's chosen kernel (see ``linear_kernel``), or its weight as stored (see ``use_stored``); ``lora``, set at
    load when the engine serves LoRA adapters, adds their product to the output."""

    kernel: LinearKernel = F.linear
    stored: QuantizedWeight | None = None
    lora: LinearAdapter | None = None

    def reset_parameters(self) -> None:
        pass

    def use_stored(self, weight: QuantizedWeight) -> None:
        """Compute with ``weight`` as stored; the float ``weight`` parameter is dropped."""
        if (weight.out_features, weight.in_features) != (self.out_features, self.in_features):
            raise ValueError(
                f"a stored weight of [{weight.out_features}, {weight.in_features}] for a linear layer of "
                f"[{self.out_features}, {self.in_features}]"
            )
        self.weight = None  # pyright: ignore[reportAttributeAccessIssue]  # the stored weight replaces it
        self.stored = weight

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # named as nn.Linear names it
        if self.stored is not None:
            out = self.stored(input, self.bias)
        else:
            out = self.kernel(input, self.weight, self.bias)
        if self.lora is not None:
            self.lora(input, out)
        return out

    __call__ = forward  # no nn.Module hook dispatch: see docs/architecture.md, "The decode step's Python"


# The thresholds below come from measurements (docs/benchmarks_gemm.md, benchmarks/bench_gemm.py): the skinny GEMM
# wins up to a few dozen rows and oneDNN past them; oneDNN's fixed cost per call loses to F.linear on small weights
# and small calls.
SKINNY_MAX_ROWS = min(64, MAX_ROWS)  # the skinny GEMM takes up to MAX_ROWS
ONEDNN_MIN_WEIGHT_NUMEL = 1 << 19
ONEDNN_MIN_WORK = 1 << 25  # rows x weight elements


def linear_kernel(
    device: torch.device, dtype: torch.dtype, *, native: bool = True, batch_invariant: bool = False
) -> tuple[str, LinearKernel]:
    """The fastest correct kernel for the model's projections on this device, with its name (``native=False``:
    without the native GEMM, to measure what it gives; ``batch_invariant``: see ``invariant_linear``).

    On CPU in float32 it picks per call, by the input's rows and the weight's size:

    - **1 to ``SKINNY_MAX_ROWS`` (64) rows** (a decode step, a short prefill chunk): the native skinny GEMM of
      ``skinny_gemm.c``. Up to 8 rows it reads each weight once for all the rows; past that it runs
      register-blocked tiles;
    - past those, and where the native library cannot be built or loaded (``enginekit.model.kernels.native`` then
      returns ``None``), **weights of ``ONEDNN_MIN_WEIGHT_NUMEL`` elements or more, or calls of
      ``ONEDNN_MIN_WORK`` multiply-adds or more**: oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``,
      the kernel torch's own compiler emits for a CPU linear). It reads the same ``[out, in]`` weights in place,
      and is used when this torch build has it and it agrees with ``F.linear`` on a probe. Its fixed cost per
      call loses to ``F.linear`` on smaller weights;
    - otherwise ``F.linear``, which is also the kernel on other devices and dtypes.

    The weights are not reordered once for oneDNN: that measured 3-10% faster past 64 rows but keeps a second
    copy of every float32 weight. The figures behind each choice are on docs/benchmarks_gemm.md
    (``benchmarks/bench_gemm.py``).
    """
    if device.type != "cpu" or dtype != torch.float32:
        return "F.linear", F.linear
    if batch_invariant:
        return invariant_linear()
    onednn = _onednn_linear()
    skinny = native_skinny_gemm() if native else None
    if onednn is None and skinny is None:
        return "F.linear", F.linear

    def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (
            skinny is not None
            and x.dim() == 2
            and 0 < x.shape[0] <= SKINNY_MAX_ROWS
            and x.is_contiguous()
            and weight.is_contiguous()
        ):
            return skinny(x, weight, bias)
        if onednn is not None and (
            weight.numel() >= ONEDNN_MIN_WEIGHT_NUMEL or x.numel() * weight.shape[0] >= ONEDNN_MIN_WORK
        ):
            return onednn(x, weight, bias, "none", [], "")
        return F.linear(x, weight, bias)

    parts = [f"native skinny GEMM at 1-{SKINNY_MAX_ROWS} rows"] if skinny is not None else []
    if onednn is not None:
        parts.append(
            f"oneDNN from {ONEDNN_MIN_WEIGHT_NUMEL} weight elements or {ONEDNN_MIN_WORK} multiply-adds"
        )
    return ", ".join([*parts, "else F.linear"]), cpu_linear


def invariant_linear() -> tuple[str, LinearKernel]:
    """The float32 CPU kernel whose every output row depends on its input row alone, whatever the other rows: the
    native skinny GEMM at every row count, in calls of at most ``MAX_ROWS`` rows. Its one-row, few-row and tiled
    loops sum each output the same way (eight-lane partial sums over the input features in order, the same
    horizontal sum, the same tail), where oneDNN past ``SKINNY_MAX_ROWS`` rows, or a BLAS at any count, may split
    and order the sums by the shape. ``ValueError`` where the native library cannot be used."""
    skinny = native_skinny_gemm()
    if skinny is None:
        raise ValueError("the batch-invariant linear needs the native skinny GEMM, which cannot be used here")

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() != 2:
            return linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
        rows = x.shape[0]
        if not x.is_contiguous():
            x = x.contiguous()
        if 0 < rows <= MAX_ROWS:
            return skinny(x, weight, bias)
        if rows == 0:
            return x.new_empty((0, weight.shape[0]))
        return torch.cat(
            [skinny(x[first : first + MAX_ROWS], weight, bias) for first in range(0, rows, MAX_ROWS)]
        )

    return (
        f"native skinny GEMM at every row count, in calls of up to {MAX_ROWS} rows (batch-invariant)",
        linear,
    )


def _onednn_linear() -> Callable[..., torch.Tensor] | None:
    """oneDNN's linear, if this torch build has it and it agrees with ``F.linear`` on a probe."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise
        x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
        if not torch.allclose(op(x, w, b, "none", [], ""), F.linear(x, w, b), atol=1e-5):
            raise RuntimeError("oneDNN's linear disagrees with F.linear on a probe")
    except (AttributeError, RuntimeError) as error:
        logger.info("CPU linear: no oneDNN (it is not usable here: %s)", error)
        return None
    return op
