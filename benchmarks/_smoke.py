"""Quick check that every baseline runs: small sizes, results printed. Not a test.

Usage: .venv/bin/python benchmarks/_smoke.py
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from baselines import (
    hf_generate_throughput,
    matmul_gflops,
    torch_import_time,
    zmq_message_rate,
    zmq_pingpong_roundtrip,
)
from stats import fmt, markdown_table, render_machine_info


def build_tiny_llama(directory: str) -> str:
    """A tiny randomly initialised Llama, saved as safetensors (only for this smoke check)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    config = LlamaConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
        intermediate_size=688,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)  # this transformers always writes safetensors
    if not any(f.endswith(".safetensors") for f in os.listdir(directory)):
        raise RuntimeError("checkpoint was not saved as safetensors")
    return directory


def main() -> None:
    warnings.simplefilter("error")
    logging.basicConfig(level=logging.WARNING)
    t_start = time.perf_counter()
    print(render_machine_info())

    pp = zmq_pingpong_roundtrip(num_messages=2000, payload_bytes=64)
    print(
        f"zmq ping-pong (64 B, 2000 round trips): p50 {pp['p50_us']:.1f} us, "
        f"p99 {pp['p99_us']:.1f} us; {fmt(pp['summary'], 'us', 1)}"
    )

    rate = zmq_message_rate(num_messages=10000, payload_bytes=64, repeats=5)
    print(
        f"zmq message rate (64 B, 10000 msgs x 5): "
        f"{fmt(rate['summary'].scaled(1e-3), 'k msg/s', 1)}, {rate['mb_per_s']:.1f} MB/s"
    )

    imp = torch_import_time(repeats=3)
    print(f"python -c 'import torch': {fmt(imp.scaled(1e3), 'ms', 0)}")

    mm = matmul_gflops(n=512, repeats=5)
    print(
        f"matmul {mm['n']}x{mm['n']} {mm['dtype']}: {fmt(mm['default'], 'GFLOP/s', 1)} "
        f"with {mm['threads']} threads; {fmt(mm['single_thread'], 'GFLOP/s', 1)} with 1 thread"
    )

    with tempfile.TemporaryDirectory(prefix="ekbench-llama-") as tmp:
        ckpt = build_tiny_llama(tmp)
        threads = torch.get_num_threads()
        rows = []
        cases = [(bs, [32], [64]) for bs in (1, 8, 32)]
        cases.append((8, [16, 32, 48, 64], [16, 32, 48, 64]))
        for bs, plens, news in cases:
            row = [bs, "/".join(map(str, plens)), "/".join(map(str, news))]
            for nt in (threads, 1):
                s = hf_generate_throughput(ckpt, bs, plens, news, repeats=3, num_threads=nt)
                row.append(fmt(s, "tok/s", 1))
            rows.append(row)
        print("transformers generate, tiny random Llama (float32, greedy), tokens/s:")
        headers = ["batch", "prompt", "new tokens", f"{threads} threads", "1 thread"]
        print(markdown_table(headers, rows, align=["r", "r", "r", "l", "l"]))
    print(f"smoke done in {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
