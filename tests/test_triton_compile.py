"""The Triton kernels compiled for a GPU (sm_90: H100/H200) on this machine, without one: Triton's compiler and
its bundled ``ptxas`` run on the CPU. The interpreter (``tests/test_triton_kernels.py``) checks what the kernels
compute but accepts code the compiler refuses (a plain float global read inside a kernel, for one), so this checks
that every kernel, in every dtype and for each of its compile-time variants, builds to a GPU binary.

The compile runs in a child process: under ``TRITON_INTERPRET=1`` (set for the test run by ``conftest.py``)
``triton.jit`` makes interpreted functions, which do not compile."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the Triton kernels' tests need triton (pip install 'triton>=3.1')")

DTYPES = ("bf16", "fp16", "fp32")


def _compile(kernel, types: dict[str, str], constants: dict, num_warps: int = 4) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {name: "constexpr" if name in constants else types[name] for name in names}
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def compile_every_kernel() -> list[str]:
    """Each kernel variant the wrappers launch, compiled; returns what was built."""
    from enginekit.model.kernels import triton_attention as attention
    from enginekit.model.kernels import triton_layer_ops as layer_ops

    built = []
    for dtype in DTYPES:
        pointer = "*" + dtype
        # (window, softcap, splits, block_m, group, head_dim, index type): decodes, a prefill block, split-K, a
        # 256-wide head with its smaller tile; the runner's int64 index tensors and build's int32 ones
        variants = [
            (False, False, 1, 16, 4, 128, "i64"),
            (True, True, 1, 64, 8, 64, "i32"),
            (False, False, 4, 16, 2, 256, "i64"),
        ]
        for window, softcap, splits, block_m, group, head_dim, index in variants:
            part = "*fp32" if splits > 1 else pointer
            types = {
                **dict.fromkeys(("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr"), pointer),
                **dict.fromkeys(("block_tables_ptr", "query_start_ptr", "seq_lens_ptr"), "*" + index),
                **dict.fromkeys(("part_out_ptr", "part_max_ptr", "part_sum_ptr"), part),
                **dict.fromkeys(("num_seqs", "window", "table_stride"), "i32"),
                **dict.fromkeys(
                    ("q_stride_token", "q_stride_head", "cache_stride_slot", "cache_stride_head"), "i32"
                ),
                "scale": "fp32",
                "softcap": "fp32",
            }
            constants = dict(
                NUM_HEADS=2 * group,
                GROUP=group,
                HEAD_DIM=head_dim,
                DIM_PAD=head_dim,
                BLOCK_SIZE=16,
                BLOCK_Q=block_m // group,
                BLOCK_M=block_m,
                TILE=64 if head_dim <= 128 else 32,
                SPLITS=splits,
                SOFTCAP=softcap,
                WINDOW=window,
                PRECISION="ieee" if dtype == "fp32" else "tf32",
            )
            _compile(attention._attention_kernel, types, constants, 4 if block_m * head_dim <= 4096 else 8)
            built.append(f"attention {dtype} window={window} softcap={softcap} splits={splits}")
        for index in ("i64", "i32"):  # the runner's query starts and build's
            merge_types = {
                "out_ptr": pointer,
                **dict.fromkeys(("part_out_ptr", "part_max_ptr", "part_sum_ptr"), "*fp32"),
                "query_start_ptr": "*" + index,
                "num_seqs": "i32",
            }
            _compile(
                attention._merge_kernel, merge_types, dict(NUM_HEADS=32, HEAD_DIM=128, DIM_PAD=128, SPLITS=4)
            )
        rope_types = {
            **dict.fromkeys(
                ("qkv_ptr", "cos_ptr", "sin_ptr", "q_out_ptr", "k_cache_ptr", "v_cache_ptr"), pointer
            ),
            "slots_ptr": "*i64",
            **dict.fromkeys(
                ("qkv_stride", "cos_stride", "sin_stride", "cache_stride_slot", "cache_stride_head"), "i32"
            ),
        }
        _compile(
            layer_ops._rope_write_cache_kernel,
            rope_types,
            dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=64, HEADS_PAD=32, KV_HEADS_PAD=8, DIM_PAD=64),
        )
        norm_types = {
            **dict.fromkeys(
                ("x_ptr", "residual_ptr", "x_weight_ptr", "weight_ptr", "sum_ptr", "out_ptr"), pointer
            ),
            "eps": "fp32",
            **dict.fromkeys(("x_stride", "residual_stride"), "i32"),
        }
        for norm_x, add, norm_sum in ((False, False, True), (True, True, True), (True, True, False)):
            flags = dict(NORM_X=norm_x, ADD=add, NORM_SUM=norm_sum)
            _compile(layer_ops._residual_norm_kernel, norm_types, dict(HIDDEN=2048, BLOCK=2048, **flags), 8)
        for gelu_tanh in (False, True):
            _compile(
                layer_ops._gated_activation_kernel,
                {"x_ptr": pointer, "out_ptr": pointer, "x_stride": "i32"},
                dict(INTER=8192, BLOCK=1024, GELU_TANH=gelu_tanh),
            )
        built.append(f"merge, rope, norms, gated activations {dtype}")
    return built


@pytest.mark.slow  # about 20 s of compiles
def test_every_triton_kernel_compiles_for_a_gpu(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled, not read from an earlier run's cache
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when it is unset
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (here, env.get("PYTHONPATH"))))
    code = "import test_triton_compile as t; print('\\n'.join(t.compile_every_kernel()))"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert len(result.stdout.splitlines()) == 4 * len(DTYPES)
