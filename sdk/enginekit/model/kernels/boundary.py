"""The boundary between Python and the native library: each entry point declared once, in ``ENTRY_POINTS``, as the
list of its C arguments and what each tensor among them must be. The ctypes signatures are generated from that
table, and one checker refuses, with a ``TypeError`` or ``ValueError``, any call the C code could not survive: a
tensor of the wrong dtype or device, rank, shape or layout, sizes that do not agree. What a tensor *holds* (block
ids, slots, table rows, context lengths) is checked by the C code itself before it touches memory, in one pass over
the tables, returning an error code that becomes a ``ValueError`` here (``Entry.errors``): a torch reduction per
table would cost more than the whole check.

A spec, e.g. ``Tensor("x", ("M", "K"))``: each dimension is a number, a name (bound to the size the first time it is
seen, then compared), or an expression of names (``"2 * inter"``), compared once every name is bound. Names can
also be given by the caller (``heads=...``). ``requires`` adds conditions on the names, each with its message.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

F32, I64, U8 = torch.float32, torch.int64, torch.uint8
Layout = Literal["contiguous", "rows"]


@dataclass(frozen=True)
class Tensor:
    """A tensor argument, passed as the address of its first value (``None`` for an absent optional one).

    ``layout``: ``"contiguous"``, or ``"rows"``: every dimension but the first contiguous, the first any stride at
    least a row (pass ``Stride(name)`` beside it)."""

    name: str
    shape: tuple[int | str, ...]
    dtype: torch.dtype = F32
    layout: Layout = "contiguous"
    optional: bool = False


@dataclass(frozen=True)
class Output:
    """A tensor the wrapper has just allocated for the result (so not checked), passed as its address."""

    name: str


@dataclass(frozen=True)
class Part:
    """The address of ``tensor[index]`` (along the first dimension) of a tensor declared before, without a view."""

    tensor: str
    index: int


@dataclass(frozen=True)
class Stride:
    """A tensor's stride along its first dimension, in elements, as a C long."""

    tensor: str


@dataclass(frozen=True)
class Size:
    """A named size (bound from the shapes, or given by the caller) as a C long."""

    name: str


@dataclass(frozen=True)
class Scalar:
    """A value the caller gives, as ``ctype``."""

    name: str
    ctype: type = ctypes.c_int


Argument = Tensor | Output | Part | Stride | Size | Scalar


@dataclass(frozen=True)
class Entry:
    """A native entry point: its symbol, its arguments in C order, its return type (``ctypes.c_int``: an error code,
    0 for success, looked up in ``errors``), and conditions on its sizes (``requires``: expression, message)."""

    symbol: str
    arguments: tuple[Argument, ...]
    restype: type | None = None
    errors: dict[int, str] = field(default_factory=dict)
    requires: tuple[tuple[str, str], ...] = ()

    def argtypes(self) -> list[type]:
        types = {
            Tensor: ctypes.c_void_p,
            Output: ctypes.c_void_p,
            Part: ctypes.c_void_p,
            Stride: ctypes.c_long,
            Size: ctypes.c_long,
        }
        return [
            argument.ctype if isinstance(argument, Scalar) else types[type(argument)]
            for argument in self.arguments
        ]

    def bind(self, lib: ctypes.CDLL) -> Kernel:
        """The entry point of ``lib`` with its generated signature, behind the checker."""
        function = getattr(lib, self.symbol)
        function.argtypes, function.restype = self.argtypes(), self.restype
        return Kernel(self, function)


class Kernel:
    """A native entry point called with keyword arguments, checked first (``kernel(x=..., out=..., threads=...)``)."""

    def __init__(self, entry: Entry, function: Callable[..., Any]) -> None:
        self.entry, self._function = entry, function
        self._tensors = [argument for argument in entry.arguments if isinstance(argument, Tensor)]
        self._dims: list[tuple[str, int, str]] = []  # (tensor, dimension, name) bound or compared
        self._exprs: list[
            tuple[str, int, str, Any]
        ] = []  # (tensor, dimension, source, code) compared afterwards
        for tensor in self._tensors:
            for dim, size in enumerate(tensor.shape):
                if isinstance(size, str) and size.isidentifier():
                    self._dims.append((tensor.name, dim, size))
                elif isinstance(size, str):
                    self._exprs.append((tensor.name, dim, size, compile(size, size, "eval")))
        self._requires = [(compile(test, test, "eval"), message) for test, message in entry.requires]
        self._layouts = {tensor.name: _layout_checker(tensor) for tensor in self._tensors}

    def __call__(self, **values: Any) -> int | None:
        symbol = self.entry.symbol
        sizes = {name: value for name, value in values.items() if isinstance(value, int)}
        for tensor in self._tensors:
            value = values.get(tensor.name)
            if value is None and tensor.optional:
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{symbol}: {tensor.name} must be a tensor, not {type(value).__name__}")
            if value.dtype is not tensor.dtype or value.device.type != "cpu":
                raise TypeError(
                    f"{symbol}: {tensor.name} must be a CPU {tensor.dtype} tensor, not {value.device.type} {value.dtype}"
                )
            if value.dim() != len(tensor.shape):
                raise ValueError(
                    f"{symbol}: {tensor.name} must have {len(tensor.shape)} dimensions, not {value.dim()}"
                )
            self._layouts[tensor.name](value, symbol)
        for name, dim, size in self._dims:
            value = values.get(name)
            if value is None:
                continue
            actual = value.shape[dim]
            if sizes.setdefault(size, actual) != actual:
                raise ValueError(
                    f"{symbol}: {name} has {actual} along dimension {dim} where {size} is {sizes[size]}"
                )
        for tensor in self._tensors:
            value = values.get(tensor.name)
            for dim, size in enumerate(tensor.shape):
                if isinstance(size, int) and value is not None and value.shape[dim] != size:
                    raise ValueError(f"{symbol}: {tensor.name} must have {size} along dimension {dim}")
        for name, dim, source, code in self._exprs:
            value = values.get(name)
            if value is not None and value.shape[dim] != (expected := eval(code, None, sizes)):
                raise ValueError(
                    f"{symbol}: {name} has {value.shape[dim]} along dimension {dim}, not {source} = {expected}"
                )
        for code, message in self._requires:
            if not eval(code, None, sizes):
                raise ValueError(f"{symbol}: {message.format(**sizes)}")
        result = self._function(*[_value(argument, values, sizes) for argument in self.entry.arguments])
        if result:  # an error code
            raise ValueError(
                f"{symbol}: {self.entry.errors.get(result, f'refused its arguments (error {result})')}"
            )
        return result


def _value(argument: Argument, values: dict[str, Any], sizes: dict[str, int]) -> Any:
    if isinstance(argument, Tensor):
        tensor = values.get(argument.name)
        return None if tensor is None else tensor.data_ptr()
    if isinstance(argument, Output):
        return values[argument.name].data_ptr()
    if isinstance(argument, Size):
        return sizes[argument.name]
    if isinstance(argument, Stride):
        return values[argument.tensor].stride(0)
    if isinstance(argument, Part):
        tensor = values[argument.tensor]
        return tensor.data_ptr() + argument.index * tensor.stride(0) * tensor.element_size()
    return values[argument.name]


def _layout_checker(spec: Tensor) -> Callable[[torch.Tensor, str], None]:
    if spec.layout == "contiguous":

        def contiguous(value: torch.Tensor, symbol: str) -> None:
            if not value.is_contiguous():
                raise ValueError(f"{symbol}: {spec.name} must be contiguous")

        return contiguous

    def rows(value: torch.Tensor, symbol: str) -> None:
        shape, strides, expected = value.shape, value.stride(), 1
        for dim in range(len(shape) - 1, 0, -1):
            if shape[dim] != 1 and strides[dim] != expected:
                raise ValueError(f"{symbol}: each row of {spec.name} must be contiguous (strides {strides})")
            expected *= shape[dim]
        if shape[0] > 1 and strides[0] < expected:
            raise ValueError(f"{symbol}: the rows of {spec.name} overlap (strides {strides})")

    return rows


def bind_all(lib: ctypes.CDLL, entries: Sequence[Entry]) -> dict[str, Kernel]:
    """Every entry point of ``lib`` in ``entries``, checked, by symbol."""
    return {entry.symbol: entry.bind(lib) for entry in entries}
