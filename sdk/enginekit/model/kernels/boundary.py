"""The boundary between Python and the native library: each entry point declared once, in ``ENTRY_POINTS``, as the
list of its C arguments and what each tensor among them must be. The ctypes signatures are generated from that
table, and one checker refuses, with a ``TypeError`` or ``ValueError``, any call the C code could not survive: a
tensor of the wrong dtype or device, rank, shape or layout, sizes that do not agree. What a tensor *holds* (block
ids, slots, table rows, context lengths) is checked by the C code itself before it touches memory, in one pass over
the tables, returning an error code that becomes a ``ValueError`` here (``Entry.errors``): a torch reduction per
table would cost more than the whole check.

A spec, e.g. ``Tensor("x", ("M", "K"))``: each dimension is a number, a name (bound to the size the first time it is
seen, then compared), or an expression of names (``"2 * inter"``), compared once every name is bound. Names can
also be given by the caller (``heads=...``, an ``int``). ``requires`` adds conditions on the names, each with its
message; they may name the library's own constants (``Entry.constants``: read from the library when the entry is
bound, so a limit is written once, in C). Every scalar is checked too: an integer must be an ``int`` within its C
type (ctypes would wrap it silently) and within its declared range (the thread count: 1 to ``MAX_THREADS``), a float
an ``int`` or ``float``.
"""

from __future__ import annotations

import ast
import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

F32, I64, U8 = torch.float32, torch.int64, torch.uint8
Layout = Literal["contiguous", "rows"]
# The most threads a native call takes: the kernels size their scratch per thread, and OpenMP starts as many threads
# as asked; a count past this is a mistake, not a machine (the wrappers cap torch's own count at it).
MAX_THREADS = 1024
_C_INTEGERS = {ctypes.c_int: 32, ctypes.c_long: 64}  # bits of the integer ctypes the entry points use


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
    """A result tensor, allocated by the checked call once every size is known (dimensions as in ``Tensor``, all
    bound by then), passed as its address, and returned."""

    name: str
    shape: tuple[int | str, ...]
    dtype: torch.dtype = F32


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
    """A value the caller gives, as ``ctype``; an integer one within ``low`` to ``high`` (default: the C type's
    range)."""

    name: str
    ctype: type = ctypes.c_int
    low: int | None = None
    high: int | None = None

    def bounds(self) -> tuple[int, int] | None:
        """The range an integer scalar must lie in (``None`` for a float one)."""
        bits = _C_INTEGERS.get(self.ctype)
        if bits is None:
            return None
        low = -(2 ** (bits - 1)) if self.low is None else self.low
        return low, 2 ** (bits - 1) - 1 if self.high is None else self.high


Argument = Tensor | Output | Part | Stride | Size | Scalar


@dataclass(frozen=True)
class Entry:
    """A native entry point: its symbol, its arguments in C order, its return type (``ctypes.c_int``: an error code,
    0 for success, looked up in ``errors``), conditions on its sizes (``requires``: expression, message), and the
    library's constants those name (``constants``: reads them from a loaded library, by name)."""

    symbol: str
    arguments: tuple[Argument, ...]
    restype: type | None = None
    errors: dict[int, str] = field(default_factory=dict)
    requires: tuple[tuple[str, str], ...] = ()
    constants: Callable[[ctypes.CDLL], dict[str, int]] | None = None

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

    def bind(self, lib: ctypes.CDLL) -> Callable[..., Any]:
        """The entry point of ``lib`` with its generated signature, behind the checker: a function of keyword
        arguments (the tensors, scalars and sizes by name) that returns the outputs (one, or a tuple)."""
        function = getattr(lib, self.symbol)
        function.argtypes, function.restype = self.argtypes(), self.restype
        return _checked(self, function, self.constants(lib) if self.constants is not None else {})


def _checked(entry: Entry, function: Callable[..., Any], constants: dict[str, int]) -> Callable[..., Any]:
    """The checker of ``entry`` as straight-line Python, generated once: a loop over the table on every call
    cost several microseconds; this costs about one per tensor (see docs/architecture.md). ``constants``: the
    library's values of the names ``requires`` uses besides the sizes."""
    tensors = [argument for argument in entry.arguments if isinstance(argument, Tensor)]
    outputs = [argument for argument in entry.arguments if isinstance(argument, Output)]
    scalar_specs = [argument for argument in entry.arguments if isinstance(argument, Scalar)]
    scalars = [argument.name for argument in scalar_specs]
    sizes: dict[str, None] = {}  # every size name, in order of appearance
    for spec in [*tensors, *outputs]:
        for size in spec.shape:
            if isinstance(size, str):
                sizes.update(dict.fromkeys(_names(size)))
    for test, _ in entry.requires:
        sizes.update(dict.fromkeys(_names(test)))
    sizes.update(dict.fromkeys(argument.name for argument in entry.arguments if isinstance(argument, Size)))
    for name in [*scalars, *constants]:
        sizes.pop(name, None)
    namespace: dict[str, Any] = {"Tensor": torch.Tensor, "empty": torch.empty, "function": function}
    namespace.update(constants)
    namespace.update(_helpers(entry.symbol))
    params = [f"{t.name}=None" if t.optional else t.name for t in tensors] + scalars
    lines = [f"def call(*, {', '.join([*params, *(f'{name}=None' for name in sizes)])}):"]
    later: list[str] = []
    for index, spec in enumerate(tensors):
        namespace[f"dtype{index}"] = spec.dtype
        body = _tensor_checks(spec, f"dtype{index}", later)
        lines += (
            [f"    if {spec.name} is not None:", *("    " + line for line in body)] if spec.optional else body
        )
    required = {size for t in tensors if not t.optional for size in t.shape if isinstance(size, str)}
    for name in sizes:  # given by the caller: an int, or missing
        if name not in required:
            lines += [f"    if type({name}) is not int: not_an_int({name!r}, {name})"]
    lines += [_scalar_check(spec) for spec in scalar_specs]
    lines += later
    for number, (test, message) in enumerate(entry.requires):
        for name, value in constants.items():  # the library's values, in the message once and for all
            message = message.replace(f"{{{name}}}", str(value))
        namespace[f"message{number}"] = message
        lines.append(f"    if not ({test}): refuse(message{number}.format(**locals()))")
    for index, output in enumerate(outputs):
        namespace[f"out_dtype{index}"] = output.dtype
        shape = ", ".join(str(size) for size in output.shape)
        lines.append(f"    {output.name} = empty(({shape},), dtype=out_dtype{index})")
    arguments = ", ".join(_argument_source(argument) for argument in entry.arguments)
    lines.append(f"    result = function({arguments})")
    if entry.restype is not None:
        namespace["errors"] = entry.errors
        lines.append("    if result: error_code(result, errors)")
    names = [output.name for output in outputs]
    if names:  # else the call writes into its arguments and returns None
        lines.append(f"    return {names[0] if len(names) == 1 else '(' + ', '.join(names) + ',)'}")
    exec(compile("\n".join(lines), f"<checked {entry.symbol}>", "exec"), namespace)
    call = namespace["call"]
    call.entry, call.source = entry, "\n".join(lines)
    return call


def _scalar_check(spec: Scalar) -> str:
    """The check of one scalar argument: an ``int`` within its bounds, or a real number."""
    name, bounds = spec.name, spec.bounds()
    if bounds is None:
        return f"    if type({name}) is not float and type({name}) is not int: not_a_number({name!r}, {name})"
    low, high = bounds
    return (
        f"    if type({name}) is not int or not {low} <= {name} <= {high}: "
        f"out_of_range({name!r}, {name}, {low}, {high})"
    )


def _tensor_checks(spec: Tensor, dtype: str, later: list[str]) -> list[str]:
    """The checks of one tensor argument (``later``: the dimensions given by expressions, checked once every name
    is bound)."""
    name, rank = spec.name, len(spec.shape)
    lines = [
        f"    if not isinstance({name}, Tensor): not_a_tensor({name!r}, {name})",
        f"    if {name}.dtype is not {dtype} or not {name}.is_cpu: wrong_dtype({name!r}, {name}, {dtype})",
        f"    shape = {name}.shape",
        f"    if len(shape) != {rank}: wrong_rank({name!r}, shape, {rank})",
    ]
    if spec.layout == "contiguous":
        lines.append(f"    if not {name}.is_contiguous(): refuse({name!r} + ' must be contiguous')")
    else:
        lines.append(f"    if not rows_ok(shape, {name}.stride()): not_rows({name!r}, {name})")
    for dim, size in enumerate(spec.shape):
        if isinstance(size, int):
            lines.append(
                f"    if shape[{dim}] != {size}: wrong_size({name!r}, {dim}, shape[{dim}], {size!r})"
            )
        elif size.isidentifier():
            lines.append(f"    if {size} is None: {size} = shape[{dim}]")
            lines.append(
                f"    elif shape[{dim}] != {size}: wrong_size({name!r}, {dim}, shape[{dim}], {size!r}, {size})"
            )
        else:
            guard = f"{name} is not None and " if spec.optional else ""
            later.append(
                f"    if {guard}{name}.shape[{dim}] != ({size}): "
                f"wrong_size({name!r}, {dim}, {name}.shape[{dim}], {size!r}, {size})"
            )
    return lines


def _argument_source(argument: Argument) -> str:
    if isinstance(argument, Tensor):
        if argument.optional:
            return f"None if {argument.name} is None else {argument.name}.data_ptr()"
        return f"{argument.name}.data_ptr()"
    if isinstance(argument, Output):
        return f"{argument.name}.data_ptr()"
    if isinstance(argument, Stride):
        return f"{argument.tensor}.stride(0)"
    if isinstance(argument, Part):
        t = argument.tensor
        return f"{t}.data_ptr() + {argument.index} * {t}.stride(0) * {t}.element_size()"
    return argument.name


def _names(source: str) -> list[str]:
    return [node.id for node in ast.walk(ast.parse(source, mode="eval")) if isinstance(node, ast.Name)]


def _helpers(symbol: str) -> dict[str, Callable[..., Any]]:
    """The failure paths of a generated checker: each raises, naming the entry point."""

    def refuse(message: str) -> None:
        raise ValueError(f"{symbol}: {message}")

    def not_a_tensor(name: str, value: Any) -> None:
        raise TypeError(f"{symbol}: {name} must be a tensor, not {type(value).__name__}")

    def wrong_dtype(name: str, value: torch.Tensor, dtype: torch.dtype) -> None:
        raise TypeError(
            f"{symbol}: {name} must be a CPU {dtype} tensor, not {value.device.type} {value.dtype}"
        )

    def wrong_rank(name: str, shape: torch.Size, rank: int) -> None:
        refuse(f"{name} must have {rank} dimensions, not {len(shape)}")

    def not_rows(name: str, value: torch.Tensor) -> None:
        refuse(f"each row of {name} must be contiguous, and the rows apart (strides {value.stride()})")

    def wrong_size(name: str, dim: int, actual: int, size: int | str, expected: int | None = None) -> None:
        if isinstance(size, int):
            refuse(f"{name} has {actual} along dimension {dim}, not {size}")
        refuse(f"{name} has {actual} along dimension {dim}, where {size} is {expected}")

    def not_an_int(name: str, value: Any) -> None:
        if value is None:
            raise TypeError(f"{symbol}: the size {name} is not given")
        raise TypeError(f"{symbol}: the size {name} must be an int, not {type(value).__name__}")

    def not_a_number(name: str, value: Any) -> None:
        raise TypeError(f"{symbol}: {name} must be a float or an int, not {type(value).__name__}")

    def out_of_range(name: str, value: Any, low: int, high: int) -> None:
        if type(value) is not int:
            raise TypeError(f"{symbol}: {name} must be an int, not {type(value).__name__}")
        refuse(f"{name} must be from {low} to {high}, got {value}")

    def error_code(code: int, errors: dict[int, str]) -> None:
        refuse(errors.get(code, f"refused its arguments (error {code})"))

    return {
        helper.__name__: helper
        for helper in (
            refuse,
            not_a_tensor,
            wrong_dtype,
            wrong_rank,
            not_rows,
            wrong_size,
            not_an_int,
            not_a_number,
            out_of_range,
            error_code,
        )
    } | {"rows_ok": _rows_ok}


def _rows_ok(shape: torch.Size, strides: tuple[int, ...]) -> bool:
    """Whether every dimension but the first is contiguous, and the rows do not overlap."""
    expected = 1
    for dim in range(len(shape) - 1, 0, -1):
        if shape[dim] != 1 and strides[dim] != expected:
            return False
        expected *= shape[dim]
    return shape[0] <= 1 or strides[0] >= expected


def bind_all(lib: ctypes.CDLL, entries: Sequence[Entry]) -> dict[str, Callable[..., Any]]:
    """Every entry point of ``lib`` in ``entries``, checked, by symbol."""
    return {entry.symbol: entry.bind(lib) for entry in entries}
