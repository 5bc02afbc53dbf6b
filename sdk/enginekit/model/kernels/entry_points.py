"""Every entry point of the native library, declared once: its C arguments in order and what each tensor among
them must be (see ``boundary.py`` for the notation). ``native.py`` binds them; the ctypes signatures and the
argument checks both come from here."""

from __future__ import annotations

import ctypes

import torch

from enginekit.model.kernels.boundary import (
    I64,
    MAX_THREADS,
    U8,
    Entry,
    Output,
    Part,
    Scalar,
    Size,
    Stride,
    Tensor,
)

THREADS = Scalar("threads", ctypes.c_int, low=1, high=MAX_THREADS)
KV_CACHE = Tensor("kv_cache", (2, "num_slots", "kv_heads", "D"))


def threads() -> int:
    """The calling thread's torch thread count, the native calls' own, capped at ``MAX_THREADS``."""
    return min(torch.get_num_threads(), MAX_THREADS)


def attention_limits(lib: ctypes.CDLL) -> dict[str, int]:
    """The native attention's limits, as ``layer_ops.c`` defines them (it keeps a task's query heads on the stack):
    query heads per KV head (``MAX_GROUP``), and those heads' values (``MAX_GROUP_FLOATS``). Written there alone."""
    limits = [ctypes.c_long() for _ in range(2)]
    lib.enginekit_layer_ops_limits(*(ctypes.byref(limit) for limit in limits))
    return {"MAX_GROUP": limits[0].value, "MAX_GROUP_FLOATS": limits[1].value}


ATTENTION_SHAPES = (
    ("heads % kv_heads == 0", "{heads} query heads are not a multiple of {kv_heads} KV heads"),
    (
        "heads // kv_heads <= MAX_GROUP and heads // kv_heads * D <= MAX_GROUP_FLOATS",
        "{heads} query heads per {kv_heads} KV heads of size {D} are past the native attention's limits "
        "({MAX_GROUP} query heads per KV head, {MAX_GROUP_FLOATS} of their values)",
    ),
)


# What paged attention reads besides the queries and the cache, the same in every entry point that attends:
# each query's row of the block tables (row i when ``table_rows`` is None) and its context length, for queries
# counted by the dimension ``rows``; and how the scores are taken.
def block_tables(rows: str) -> tuple[Tensor | Stride, ...]:
    return (
        Tensor("block_tables", ("table_count", "table_width"), I64, layout="rows"),
        Stride("block_tables"),
        Tensor("table_rows", (rows,), I64, optional=True),
        Tensor("context_lens", (rows,), I64),
    )


SCORES = (Scalar("scale", ctypes.c_float), Scalar("window", ctypes.c_long), Scalar("softcap", ctypes.c_float))

SKINNY_GEMM = Entry(
    "enginekit_skinny_gemm",
    (
        Tensor("weight", ("N", "K")),
        Tensor("x", ("M", "K")),
        Tensor("bias", ("N",), optional=True),
        Output("out", ("M", "N")),
        Size("M"),
        Size("N"),
        Size("K"),
        THREADS,
    ),
    ctypes.c_int,
    {-1: "takes 1 to 128 rows"},
)
RMS_NORM = Entry(
    "enginekit_rms_norm",
    (
        Tensor("x", ("rows", "size"), layout="rows"),
        Stride("x"),
        Tensor("weight", ("size",)),
        Output("out", ("rows", "size")),
        Size("rows"),
        Size("size"),
        Scalar("eps", ctypes.c_float),
        THREADS,
    ),
)
SILU_MUL = Entry(
    "enginekit_silu_mul",
    (
        Tensor("gate_up", ("rows", "2 * inter"), layout="rows"),
        Stride("gate_up"),
        Output("out", ("rows", "inter")),
        Size("rows"),
        Size("inter"),
        THREADS,
    ),
)
GELU_TANH_MUL = Entry(
    "enginekit_gelu_tanh_mul",
    (
        Tensor("gate_up", ("rows", "2 * inter"), layout="rows"),
        Stride("gate_up"),
        Output("out", ("rows", "inter")),
        Size("rows"),
        Size("inter"),
        THREADS,
    ),
)
ROPE_WRITE_CACHE = Entry(
    "enginekit_rope_write_cache",
    (
        Tensor("qkv", ("T", "(heads + 2 * kv_heads) * D"), layout="rows"),
        Stride("qkv"),
        Tensor("cos", ("T", 1, "D")),
        Tensor("signed_sin", ("T", 1, "D")),
        Tensor("slots", ("T",), I64),
        Output("qk", ("T", "heads + kv_heads", "D")),
        KV_CACHE,
        Part("kv_cache", 1),
        Size("T"),
        Size("heads"),
        Size("kv_heads"),
        Size("D"),
        Size("num_slots"),
        THREADS,
    ),
    ctypes.c_int,
    {-1: "a slot is outside the KV cache"},
    requires=(*ATTENTION_SHAPES, ("D % 2 == 0", "the head size {D} is odd")),
    constants=attention_limits,
)
PAGED_ATTENTION = Entry(
    "enginekit_paged_attention",
    (
        Tensor("q", ("N", "heads", "D"), layout="rows"),
        Stride("q"),
        KV_CACHE,
        Part("kv_cache", 1),
        *block_tables("N"),
        Output("out", ("N", "heads", "D")),
        Size("N"),
        Size("heads"),
        Size("kv_heads"),
        Size("D"),
        Size("block_size"),
        Size("num_slots"),
        Size("table_count"),
        Size("table_width"),
        *SCORES,
        THREADS,
    ),
    ctypes.c_int,
    {
        -1: "a table row is outside the block tables",
        -2: "a context length is negative or longer than its block table",
        -3: "a block id is outside the KV cache",
    },
    requires=(
        *ATTENTION_SHAPES,
        (
            "block_size > 0 and block_size & (block_size - 1) == 0",
            "the block size {block_size} is not a power of two",
        ),
        ("num_slots % block_size == 0", "the cache's {num_slots} slots are not whole blocks of {block_size}"),
    ),
    constants=attention_limits,
)
QUANT_GEMM = Entry(
    "enginekit_quant_gemm",
    (
        Tensor("x", ("M", "K")),
        Tensor("blocks", ("N", "row_bytes"), U8),
        Scalar("qtype"),
        Output("out", ("M", "N")),
        Size("M"),
        Size("N"),
        Size("K"),
        THREADS,
        Scalar("isa"),
        Scalar("path"),
    ),
    ctypes.c_int,
    {
        -1: "has no kernel for this type",
        -2: "got a shape that is not whole blocks",
        -3: "is out of memory",
        -4: "this CPU lacks that instruction set",
        -5: "has no such path for this type or instruction set (bf16: AVX-512 BF16 only)",
    },
    requires=(
        ("K % block_size == 0", "{K} input features are not a whole number of blocks of {block_size}"),
        (
            "row_bytes == K // block_size * type_size",
            "the rows hold {row_bytes} bytes, not the {K} features' "
            "{K} // {block_size} blocks x {type_size} bytes",
        ),
    ),
)
DEQUANTIZE = Entry(
    "enginekit_dequantize",
    (
        Tensor("blocks", ("N", "row_bytes"), U8),
        Scalar("qtype"),
        Output("out", ("N", "K")),
        Size("N"),
        Size("K"),
        THREADS,
    ),
    ctypes.c_int,
    {-1: "has no kernel for this type", -2: "got a shape that is not whole blocks"},
    requires=QUANT_GEMM.requires,
)
STORED_LAYER = Entry(
    "enginekit_stored_layer",
    (
        Tensor("hidden", ("T", "H")),
        Size("T"),
        Size("H"),
        Tensor("norm1", ("H",)),
        Tensor("norm2", ("H",)),
        Scalar("eps", ctypes.c_float),
        Tensor("w_qkv", ("(heads + 2 * kv_heads) * D", "qkv_bytes"), U8),
        Scalar("t_qkv"),
        Size("qkv_bytes"),
        Tensor("b_qkv", ("(heads + 2 * kv_heads) * D",), optional=True),
        Tensor("w_o", ("H", "o_bytes"), U8),
        Scalar("t_o"),
        Size("o_bytes"),
        Tensor("w_gate_up", ("2 * inter", "gate_up_bytes"), U8),
        Scalar("t_gate_up"),
        Size("gate_up_bytes"),
        Tensor("w_down", ("H", "down_bytes"), U8),
        Scalar("t_down"),
        Size("down_bytes"),
        Size("inter"),
        Tensor("cos", ("T", 1, "D")),
        Tensor("signed_sin", ("T", 1, "D")),
        Tensor("slots", ("T",), I64),
        KV_CACHE,
        Part("kv_cache", 1),
        Size("heads"),
        Size("kv_heads"),
        Size("D"),
        Size("num_slots"),
        *block_tables("T"),
        Size("table_count"),
        Size("table_width"),
        Size("block_size"),
        *SCORES,
        THREADS,
        Scalar("isa"),
        Scalar("path"),
    ),
    ctypes.c_int,
    {
        -1: "has no kernel for a weight's type",
        -2: "got a weight whose rows are not whole blocks",
        -3: "is out of memory",
        -4: "this CPU lacks that instruction set",
        -5: "has no such path for a weight's type or this instruction set",
        -10: "got a weight whose rows do not hold its input features' blocks",
        -11: "got a slot outside the KV cache",
        -12: "got a table row outside the block tables",
        -13: "got a context length that is negative or longer than its block table",
        -14: "got a block id outside the KV cache",
    },
    requires=(*PAGED_ATTENTION.requires, ("D % 2 == 0", "the head size {D} is odd")),
    constants=attention_limits,
)

ENTRY_POINTS = (
    SKINNY_GEMM,
    RMS_NORM,
    SILU_MUL,
    GELU_TANH_MUL,
    ROPE_WRITE_CACHE,
    PAGED_ATTENTION,
    QUANT_GEMM,
    DEQUANTIZE,
    STORED_LAYER,
)
