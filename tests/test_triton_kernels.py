"""The Triton kernels (``model/kernels/triton_*.py``) run by Triton's interpreter on the CPU, against the torch code
they replace: paged attention against the gather/SDPA path of ``layers/paged_attention.py``, the rotation with the
cache write, the norms and the gated activations against the layers' torch code, and a whole decoder's forward
pass through the Triton path against its torch path.

The half-precision kernels are compared with the torch path run in float32 on the same (rounded) inputs: the
kernels compute in float32 and round once, where the torch code in the same dtype rounds at every op."""

from __future__ import annotations

import os
import random

import msgspec
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the Triton kernels' tests need triton (pip install 'triton>=3.1')")

import numpy as np
import triton.language as tl
from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

from enginekit.model.builtin import BUILTIN_CONFIG
from enginekit.model.config import ModelConfig
from enginekit.model.decoder import Decoder
from enginekit.model.kernels.triton_path import PagedAttentionInputs, TritonOps, triton_ops
from enginekit.model.layers.paged_attention import AttentionMetadata, PrefillChunk, paged_attention
from enginekit.model.layers.rotary import RotaryEmbedding, rotate

# Tolerances of a half-precision result against float32: a few units in the last place.
TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 2.5e-2, "rtol": 2.5e-2},
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _create_dot(self, a, b, acc, input_precision, max_num_imprecise_acc):
    """The interpreter's ``tl.dot`` with bfloat16 operands taken as their values (float32, exactly), as a GPU's
    tensor cores take them. NOTE: Triton's interpreter does no bfloat16 arithmetic (its docs: convert to float32
    first); it keeps bfloat16 as uint16 bits and its ``tl.dot`` multiplies those (triton-lang/triton#11584). The
    kernels convert every other bfloat16 value before computing; their dots take them as they are, for the GPU."""
    a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
    return _interpreted_dot(self, a, b, acc, input_precision, max_num_imprecise_acc)


def _cast(self, src, dst_type):
    """The interpreter's casts, with float32 to bfloat16 rounded to nearest even as on a GPU (and in torch); the
    interpreter truncates, which biases every rounding toward zero."""
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
        return TensorHandle(rounded.numpy().view(np.uint16), tl.bfloat16)
    return _interpreted_cast(self, src, dst_type)


_interpreted_dot, _interpreted_cast = InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl


@pytest.fixture(scope="module")
def ops():
    """The kernels, run by the interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` before anything
    imports triton)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on the CPU only in Triton's interpreter: TRITON_INTERPRET=1")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InterpreterBuilder, "create_dot", _create_dot)
        patch.setattr(InterpreterBuilder, "cast_impl", _cast)
        yield TritonOps()


def test_the_triton_path_is_chosen_on_cuda_only(monkeypatch):
    assert triton_ops(torch.device("cpu")) is None  # the CPU keeps its native C kernels and torch
    monkeypatch.setenv("ENGINEKIT_TRITON_KERNELS", "0")
    assert triton_ops(torch.device("cuda")) is None


# --------------------------------------------------------------------------------------
# Paged attention
# --------------------------------------------------------------------------------------

# (new tokens, context length after the step) per sequence; decodes first, as the torch path takes them
LAYOUTS = {
    "decodes": [(1, 1), (1, 17), (1, 40), (1, 100)],
    "fresh-prefill": [(23, 23)],
    "prefill-after-context": [(12, 50), (30, 95)],
    "mixed": [(1, 3), (1, 70), (1, 33), (9, 41), (16, 16), (5, 80)],
    "long-decodes": [(1, 300), (1, 129), (1, 2)],
}


class Step:
    """A random step over a scattered paged cache: queries, the new keys and values, the context already cached."""

    def __init__(self, layout, heads, kv_heads, head_dim, block_size, dtype, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.query_lens, self.seq_lens = [n for n, _ in layout], [length for _, length in layout]
        self.block_size = block_size
        blocks = [-(-length // block_size) for length in self.seq_lens]
        ids = list(range(sum(blocks) + 3))
        random.Random(seed).shuffle(ids)
        self.tables = [[ids.pop() for _ in range(count)] for count in blocks]
        slots = (sum(blocks) + 3) * block_size

        def rand(*shape):
            return torch.randn(*shape, generator=generator).to(dtype)

        self.cache = rand(
            2, slots, kv_heads, head_dim
        )  # every slot filled: what is not attended must not count
        tokens = sum(self.query_lens)
        self.q, self.k, self.v = (
            rand(tokens, heads, head_dim),
            rand(tokens, kv_heads, head_dim),
            rand(tokens, kv_heads, head_dim),
        )
        self.inputs = PagedAttentionInputs.build(
            query_lens=self.query_lens,
            seq_lens=self.seq_lens,
            block_tables=self.tables,
            block_size=block_size,
            device="cpu",
        )
        self.scale = head_dim**-0.5

    def torch_metadata(self) -> AttentionMetadata:
        """The torch path's metadata as the runner builds it: the decodes in one batch, then each prefill chunk."""
        size, meta = self.block_size, AttentionMetadata(self.inputs.slot_mapping, self.block_size)
        decodes = [i for i, n in enumerate(self.query_lens) if n == 1]
        assert decodes == list(range(len(decodes)))  # decodes first
        if decodes:
            lens = [self.seq_lens[i] for i in decodes]
            width = -(-max(lens) // size)
            meta.num_decode, meta.decode_len = len(decodes), max(lens)
            tables = [self.tables[i][:width] for i in decodes]
            meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
            meta.decode_mask = (torch.arange(max(lens))[None] < torch.tensor(lens)[:, None])[:, None, None, :]
        row = len(decodes)
        for new, length, table in list(zip(self.query_lens, self.seq_lens, self.tables))[len(decodes) :]:
            chunk = PrefillChunk(row, new, length - new)
            if length > new:
                chunk.block_table = torch.tensor(table)
                chunk.mask = torch.arange(length)[None] <= torch.arange(length - new, length)[:, None]
            meta.prefills.append(chunk)
            row += new
        return meta

    def expected(self, window=0, softcap=0.0) -> torch.Tensor:
        """The torch path in float32 (it writes the new keys and values itself)."""
        cache = self.cache.float()
        q, k, v = self.q.float(), self.k.float(), self.v.float()
        return paged_attention(q, k, v, cache, self.torch_metadata(), self.scale, None, window, softcap)

    def triton(self, ops, window=0, softcap=0.0, num_splits=1) -> torch.Tensor:
        cache = self.cache.clone()
        cache[0, self.inputs.slot_mapping], cache[1, self.inputs.slot_mapping] = self.k, self.v
        return ops.paged_attention(self.q, cache, self.inputs, self.scale, window, softcap, num_splits)


# (layout, heads, KV heads, head dim, block size, dtype): every layout, GQA 1/2/4/8, head dims 32 (the built-in
# model's), 64, 80, 128, block sizes 16 and 32, every dtype
CASES = [
    ("decodes", 8, 2, 64, 16, "float32"),
    ("decodes", 8, 1, 128, 32, "bfloat16"),
    ("fresh-prefill", 4, 4, 128, 16, "float16"),
    ("prefill-after-context", 8, 2, 64, 32, "float32"),
    ("prefill-after-context", 8, 1, 64, 16, "bfloat16"),
    ("mixed", BUILTIN_CONFIG.num_heads, BUILTIN_CONFIG.num_kv_heads, BUILTIN_CONFIG.head_dim, 16, "float32"),
    ("mixed", BUILTIN_CONFIG.num_heads, BUILTIN_CONFIG.num_kv_heads, BUILTIN_CONFIG.head_dim, 16, "bfloat16"),
    ("mixed", 4, 4, 64, 32, "float16"),
    ("mixed", 8, 1, 128, 16, "float16"),
    ("mixed", 4, 1, 80, 16, "float32"),
]
SLOW_CASES = [
    ("decodes", 4, 4, 128, 16, "float16"),
    ("fresh-prefill", 8, 1, 64, 32, "bfloat16"),
    ("prefill-after-context", 4, 4, 128, 16, "float32"),
    ("mixed", 8, 2, 128, 32, "bfloat16"),
    ("mixed", 8, 2, 64, 16, "float32"),
]


def _case_id(case) -> str:
    layout, heads, kv_heads, head_dim, block_size, dtype = case
    return f"{layout}-gqa{heads // kv_heads}-d{head_dim}-b{block_size}-{dtype}"


@pytest.mark.parametrize(
    "case",
    [*CASES, *(pytest.param(case, marks=pytest.mark.slow) for case in SLOW_CASES)],
    ids=_case_id,
)
def test_paged_attention_matches_the_torch_path(ops, case):
    layout, heads, kv_heads, head_dim, block_size, dtype = case
    step = Step(LAYOUTS[layout], heads, kv_heads, head_dim, block_size, DTYPES[dtype])
    torch.testing.assert_close(step.triton(ops).float(), step.expected(), **TOLERANCE[DTYPES[dtype]])


@pytest.mark.parametrize(
    ("window", "softcap", "dtype"),
    [
        (5, 0.0, "float32"),
        (20, 0.0, "bfloat16"),
        (0, 2.0, "float32"),
        (0, 2.0, "float16"),
        (7, 1.5, "bfloat16"),
    ],
    ids=["window5", "window20-bfloat16", "softcap", "softcap-float16", "window-softcap-bfloat16"],
)
def test_sliding_window_and_soft_capping_match_the_torch_path(ops, window, softcap, dtype):
    step = Step(LAYOUTS["mixed"], 8, 2, 64, 16, DTYPES[dtype])
    expected = step.expected(window, softcap)
    torch.testing.assert_close(
        step.triton(ops, window, softcap).float(), expected, **TOLERANCE[DTYPES[dtype]]
    )
    assert not torch.allclose(
        expected, step.expected(), atol=0.1
    )  # the window or the cap did change the output


@pytest.mark.parametrize(
    ("layout", "splits", "window", "dtype"),
    [
        ("long-decodes", 4, 0, "float32"),
        pytest.param("long-decodes", 2, 100, "bfloat16", marks=pytest.mark.slow),
        pytest.param("mixed", 8, 0, "float16", marks=pytest.mark.slow),
    ],
)
def test_split_contexts_merge_to_the_same_attention(ops, layout, splits, window, dtype):
    """Split-K: each program's keys in ``splits`` parts (some of them empty for short contexts), merged."""
    step = Step(LAYOUTS[layout], 8, 2, 64, 16, DTYPES[dtype])
    torch.testing.assert_close(
        step.triton(ops, window, num_splits=splits).float(), step.expected(window), **TOLERANCE[DTYPES[dtype]]
    )


def test_sequences_attend_in_any_order_of_the_flat_batch(ops):
    """The kernel needs no decodes-first order: a prefill chunk before the decodes gives each row the same."""
    step = Step(LAYOUTS["mixed"], 4, 2, 32, 16, torch.float32)
    order = [4, 0, 3, 1, 5, 2]
    reordered = Step([LAYOUTS["mixed"][i] for i in order], 4, 2, 32, 16, torch.float32)
    starts = step.inputs.query_start.tolist()
    rows = [torch.arange(starts[i], starts[i + 1]) for i in order]
    reordered.q, reordered.k, reordered.v = (t[torch.cat(rows)] for t in (step.q, step.k, step.v))
    reordered.cache = step.cache.clone()  # the same contexts: the same tables, moved with their sequences
    reordered.tables = [step.tables[i] for i in order]
    reordered.inputs = PagedAttentionInputs.build(
        query_lens=reordered.query_lens,
        seq_lens=reordered.seq_lens,
        block_tables=reordered.tables,
        block_size=16,
        device="cpu",
    )
    torch.testing.assert_close(reordered.triton(ops), step.triton(ops)[torch.cat(rows)], atol=1e-6, rtol=1e-6)


def test_int64_layouts_attend_as_int32_ones(ops):
    """The runner hands the kernel int64 views of its staged inputs (no cast per step): the same attention."""
    step = Step(LAYOUTS["mixed"], 8, 2, 64, 16, torch.float32)
    expected = step.triton(ops, window=20)
    step.inputs = PagedAttentionInputs(
        **{
            **vars(step.inputs),
            "block_tables": step.inputs.block_tables.long(),
            "query_start": step.inputs.query_start.long(),
            "seq_lens": step.inputs.seq_lens.long(),
        }
    )
    torch.testing.assert_close(step.triton(ops, window=20), expected, atol=0, rtol=0)


@pytest.mark.parametrize("splits", [1, 4])
def test_a_padded_step_attends_as_the_unpadded_one_with_zeros_past_it(ops, splits):
    """What a mixed-step graph replays (``MixedGraphs``): the tokens padded past the sequences' (in no sequence),
    the sequences padded with some of no new token and full-width tables. The real rows attend as before; the
    padding rows are zeros, also where split parts are merged (a padding row has no parts to merge)."""
    step = Step(LAYOUTS["mixed"], 8, 2, 64, 16, torch.float32)
    expected = step.triton(ops, num_splits=splits)
    real = PagedAttentionInputs(**vars(step.inputs))
    tokens, seqs = step.q.shape[0], len(step.query_lens)
    pad_tokens, pad_seqs = 13, 3
    tables = torch.zeros(seqs + pad_seqs, real.block_tables.shape[1] + 4, dtype=torch.int32)
    tables[:seqs, : real.block_tables.shape[1]] = real.block_tables
    step.inputs = PagedAttentionInputs(
        **{
            **vars(real),
            "slot_mapping": torch.cat([real.slot_mapping, torch.full((pad_tokens,), -1)]),
            "block_tables": tables,
            "query_start": torch.cat([real.query_start, torch.full((pad_seqs,), tokens, dtype=torch.int32)]),
            "seq_lens": torch.cat([real.seq_lens, torch.zeros(pad_seqs, dtype=torch.int32)]),
            "max_seq_len": tables.shape[1] * 16,
            "padded": True,
        }
    )
    step.q = torch.cat([step.q, torch.randn(pad_tokens, *step.q.shape[1:])])
    step.inputs.slot_mapping = (
        real.slot_mapping
    )  # the test's own cache write: the real tokens' keys and values
    got = step.triton(ops, num_splits=splits)
    torch.testing.assert_close(got[:tokens], expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(got[tokens:], torch.zeros_like(got[tokens:]))


def test_paged_attention_refuses_mismatched_inputs(ops):
    step = Step(LAYOUTS["decodes"], 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="query heads over 3 KV heads"):
        ops.paged_attention(step.q, torch.zeros(2, 64, 3, 32), step.inputs, 1.0)
    with pytest.raises(ValueError, match="must be int32 or int64"):
        inputs = PagedAttentionInputs(**{**vars(step.inputs), "seq_lens": step.inputs.seq_lens.float()})
        ops.paged_attention(step.q, step.cache, inputs, 1.0)
    with pytest.raises(ValueError, match="num_splits must be a power of two"):
        ops.paged_attention(step.q, step.cache, step.inputs, 1.0, num_splits=3)
    with pytest.raises(ValueError, match="at least one new token and a block for each"):
        PagedAttentionInputs.build(
            query_lens=[1], seq_lens=[40], block_tables=[[0, 1]], block_size=16, device="cpu"
        )


# --------------------------------------------------------------------------------------
# The layer operations
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rope_write_cache_matches_rotate_and_index_copy(ops, dtype):
    heads, kv_heads, head_dim, tokens = 8, 2, 64, 5
    config = msgspec.structs.replace(BUILTIN_CONFIG, head_dim=head_dim)
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    cos, sin = RotaryEmbedding(config)(torch.tensor([0, 3, 17, 200, 4095]), dtype)
    cache = torch.randn(2, 32, kv_heads, head_dim, generator=generator).to(dtype)
    slots = torch.tensor([7, 0, 31, -1, 12])  # -1: a row whose key and value go nowhere

    expected_cache = cache.float().clone()
    qk = rotate(
        qkv[:, : (heads + kv_heads) * head_dim].float().view(tokens, -1, head_dim), cos.float(), sin.float()
    )
    written = slots >= 0
    expected_cache[0, slots[written]] = qk[written, heads:]
    expected_cache[1, slots[written]] = (
        qkv[written, (heads + kv_heads) * head_dim :].float().view(-1, kv_heads, head_dim)
    )

    q = ops.rope_write_cache(qkv, cos, sin, slots, cache, heads, kv_heads)
    torch.testing.assert_close(q.float(), qk[:, :heads], **TOLERANCE[dtype])
    torch.testing.assert_close(cache.float(), expected_cache, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("hidden", [BUILTIN_CONFIG.hidden_size, 96])
def test_norms_match_the_torch_layers(ops, dtype, hidden):
    from enginekit.model.layers.norm import RMSNorm

    generator = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(6, hidden, generator=generator).to(dtype) * 3 for _ in range(2))
    norms = [RMSNorm(hidden, 1e-6).to(dtype).requires_grad_(False) for _ in range(2)]
    for norm in norms:
        norm.weight.data = (1 + 0.5 * torch.randn(hidden, generator=generator)).to(dtype)
    first, second = norms
    total = residual + x
    cases = {  # the torch code of each use, and the kernel's
        "norm": (first(x), ops.rms_norm(x, first.weight, 1e-6)),
        "add, norm": (
            (total, second(total)),
            ops.residual_norm(x, residual, 1e-6, weight=second.weight),
        ),
        "norm, add, norm (sandwich)": (
            (residual + first(x), second(residual + first(x))),
            ops.residual_norm(x, residual, 1e-6, x_weight=first.weight, weight=second.weight),
        ),
        "norm, add": (
            (residual + first(x),) * 2,
            ops.residual_norm(x, residual, 1e-6, x_weight=first.weight),
        ),
    }
    for name, (expected, got) in cases.items():
        for want, have in zip(
            expected if isinstance(expected, tuple) else [expected], got if isinstance(got, tuple) else [got]
        ):
            torch.testing.assert_close(
                have, want, **TOLERANCE[dtype], msg=lambda m, name=name: f"{name}: {m}"
            )


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("gelu_tanh", [False, True], ids=["silu", "gelu_tanh"])
def test_gated_activation_matches_the_mlp(ops, dtype, gelu_tanh):
    inter = 1100  # past one program's 1024 columns, not a power of two
    gate_up = (torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    gate, up = gate_up.split(inter, dim=-1)
    expected = (F.gelu(gate, approximate="tanh") if gelu_tanh else F.silu(gate)) * up
    torch.testing.assert_close(
        ops.gated_activation(gate_up, gelu_tanh=gelu_tanh), expected, **TOLERANCE[dtype]
    )


# --------------------------------------------------------------------------------------
# A whole decoder, through the layers' hooks
# --------------------------------------------------------------------------------------

GEMMA_LIKE = ModelConfig(
    architecture="gemma2",
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_local_theta=1000.0,
    max_position_embeddings=256,
    qk_norm=True,
    hidden_act="gelu_pytorch_tanh",
    sandwich_norms=True,
    scale_embeddings=True,
    attention_scale=0.2,
    attn_logit_softcap=5.0,
    final_logit_softcap=10.0,
    layer_windows=(6, 0),
)


@pytest.mark.parametrize(
    ("config", "dtype"),
    [
        (BUILTIN_CONFIG, torch.float32),
        pytest.param(BUILTIN_CONFIG, torch.bfloat16, marks=pytest.mark.slow),
        (GEMMA_LIKE, torch.float32),
        pytest.param(GEMMA_LIKE, torch.bfloat16, marks=pytest.mark.slow),
    ],
    ids=["builtin-float32", "builtin-bfloat16", "gemma-like-float32", "gemma-like-bfloat16"],
)
def test_a_decoder_step_through_the_triton_path_matches_the_torch_path(ops, config, dtype):
    """Decodes, a chunk after its context and a fresh prompt in one step, through the layers' hooks: in float32 the
    logits and every layer's cache as the torch path's; in bfloat16 the logits no further from float32's than
    the torch path's bfloat16 logits, within a factor (the kernels keep the softmax weights in bfloat16 for the
    product with the values, as flash attention does; torch's CPU attention keeps them in float32)."""
    torch.manual_seed(0)
    model = Decoder(config).requires_grad_(False)
    for name, parameter in model.named_parameters():
        fan_in = parameter.shape[-1] if parameter.dim() == 2 else 1
        scale = 0.3 if "norm" in name else fan_in**-0.5
        parameter.data = (("norm" in name) + scale * torch.randn(parameter.shape)).to(dtype).float()
    model.use_triton(ops)
    step = Step(
        [(1, 9), (1, 20), (7, 19), (5, 5)], config.num_heads, config.num_kv_heads, config.head_dim, 16, dtype
    )
    caches = [step.cache] + [
        torch.randn_like(step.cache.float()).to(dtype) for _ in range(config.num_layers - 1)
    ]
    tokens = torch.randint(3, config.vocab_size, (sum(step.query_lens),))
    positions = torch.cat(
        [torch.arange(length - new, length) for new, length in zip(step.query_lens, step.seq_lens)]
    )
    sampled = step.inputs.query_start[1:].long() - 1  # each sequence's last row
    triton_meta = step.torch_metadata()
    triton_meta.kernel_inputs = step.inputs

    def run(meta, dtype):
        model.to(dtype)
        kv_caches = [cache.to(dtype, copy=True) for cache in caches]
        return model(tokens, positions, kv_caches, meta, sampled), kv_caches

    expected, expected_caches = run(step.torch_metadata(), torch.float32)
    logits, triton_caches = run(triton_meta, dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        for cache, expected_cache in zip(triton_caches, expected_caches):
            torch.testing.assert_close(cache, expected_cache, atol=1e-5, rtol=1e-5)
        return
    torch_error = (run(step.torch_metadata(), dtype)[0] - expected).abs().max()
    assert (logits - expected).abs().max() <= 2.5 * torch_error


# --------------------------------------------------------------------------------------
# A whole engine: the runner's step layout through the kernels
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_checkpoint(tmp_path_factory):
    """A Gemma 2 model: sliding-window layers (of 6 tokens: shorter than the prompts), soft-capping, sandwich
    norms, GeLU-tanh."""
    from hf_checkpoints import build_checkpoint

    return str(build_checkpoint(tmp_path_factory.mktemp("triton-gemma2"), "gemma2", sliding_window=6))


@pytest.mark.parametrize(
    ("model", "cuda_graphs"),
    [
        ("builtin", False),
        pytest.param("builtin", True, marks=pytest.mark.slow),  # about 10-25 s each on a busy machine
        pytest.param("gemma2", False, marks=pytest.mark.slow),
        pytest.param("gemma2", True, marks=pytest.mark.slow),
    ],
    ids=["builtin-eager", "builtin-padded", "gemma2-eager", "gemma2-padded"],
)
def test_an_engine_on_the_triton_path_generates_the_torch_paths_greedy_tokens(
    ops, gemma_checkpoint, monkeypatch, model, cuda_graphs
):
    """The runner's ``PagedAttentionInputs`` (staged with the step's inputs, the tables' rows gathered) drive the
    kernels through decodes, chunked prefills and mixed steps: the greedy tokens are the torch path's. With
    ``cuda_graphs`` the steps take the padded static-buffer paths that CUDA graphs record (run eagerly here): the
    pure-decode steps ``DecodeGraphs``', the steps with prefill chunks ``MixedGraphs``'."""
    from enginekit import Engine, SamplingParams

    checkpoint = "builtin" if model == "builtin" else gemma_checkpoint
    options = dict(
        mode="inproc",
        block_size=8,
        num_kv_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=24,  # prompts past it are chunked, and chunks share steps with decodes
        max_model_len=128,
        cuda_graphs=cuda_graphs,
    )
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(n)]} for n in (3, 30, 11, 19)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with Engine(checkpoint, **options) as engine:
        expected = [o.outputs[0].token_ids for o in engine.generate(prompts, params, progress=False)]
        calls = []
        kernels = TritonOps()
        attend = kernels.paged_attention
        monkeypatch.setattr(kernels, "paged_attention", lambda *a, **k: calls.append(1) or attend(*a, **k))
        runner = engine.client.core.runner
        runner.model.use_triton(kernels)
        got = [o.outputs[0].token_ids for o in engine.generate(prompts, params, progress=False)]
        if cuda_graphs:  # both padded paths ran: steps of decodes alone, and steps with prefill chunks
            assert runner.decode_graphs.steps and runner.mixed_graphs.steps
            # what the engine runs on CUDA as it starts: every token count on padding alone, writing no slot
            mixed, cached = runner.mixed_graphs, [cache.clone() for cache in runner.kv_caches]
            for cache in runner.kv_caches:  # every slot marked, the scratch slot of padded decodes too
                cache.fill_(0.5)
            mixed.steps.clear()
            assert mixed.capture_at_start(1000.0) == len(mixed.token_buckets) == 2  # 16 and 24 tokens
            for step in mixed.steps.values():
                assert torch.isfinite(step()).all()
            assert all(bool((cache == 0.5).all()) for cache in runner.kv_caches)
            for cache, before in zip(runner.kv_caches, cached):
                cache.copy_(before)
            again = [o.outputs[0].token_ids for o in engine.generate(prompts, params, progress=False)]
            assert [list(t) for t in again] == [list(t) for t in expected]
    assert calls  # the kernels did run
    assert [list(t) for t in got] == [list(t) for t in expected]


@pytest.mark.slow  # about 30-60 s on a busy machine: transformers' references, then the interpreted kernels
def test_adapters_run_in_the_padded_steps_of_the_triton_path(ops, tmp_path):
    """With ``cuda_graphs`` and LoRA, the steps whose rows use adapters take the padded paths too, mixed steps
    included: the adapters' dense product, masked per row, is part of every graph. The greedy tokens are
    transformers' on the merged model (and on the base for the rows of no adapter)."""
    from enginekit import Engine, LoRARequest, SamplingParams
    from hf_checkpoints import build_checkpoint, hf_greedy
    from lora_adapters import build_adapter, merge_adapter

    base = build_checkpoint(tmp_path / "base", "llama")
    adapter = build_adapter(base, tmp_path / "adapter", seed=1)
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (3, 30, 11, 19)]
    with_adapter = hf_greedy(merge_adapter(base, adapter, tmp_path / "merged"), prompts, 10)
    without = hf_greedy(base, prompts, 10)
    expected = [with_adapter[0], without[1], with_adapter[2], with_adapter[3]]
    request = LoRARequest("all", 1, str(adapter))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    options = dict(
        block_size=8, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=24, max_model_len=128
    )
    with Engine(
        str(base), mode="inproc", enable_lora=True, max_loras=2, cuda_graphs=True, **options
    ) as engine:
        runner = engine.client.core.runner
        runner.model.use_triton(ops)
        static_steps = []
        begin_step = runner.lora.begin_step

        def spy(slots, counts, *, static=False):
            if static:
                static_steps.append((slots, list(counts)))
            begin_step(slots, counts, static=static)

        runner.lora.begin_step = spy
        outputs = engine.generate(
            [{"prompt_token_ids": p} for p in prompts],
            params,
            lora_request=[request, None, request, request],
            progress=False,
        )
        assert runner.decode_graphs.steps and runner.mixed_graphs.steps
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    with_adapters = [counts for slots, counts in static_steps if slots and max(slots) >= 0]
    assert any(max(counts) > 1 for counts in with_adapters)  # a mixed step's prefill chunk, with an adapter
    assert any(max(counts) == 1 for counts in with_adapters)  # a pure decode step
