"""llama.cpp as a baseline, through llama-cpp-python's low-level API: greedy decoding of several sequences in
one batch (what a llama.cpp server does with parallel slots), or one sequence at a time.

``Llama.generate`` in the high-level API decodes one sequence; several requests there run one after another.
Here one context holds up to ``max_sequences`` sequences in a unified KV cache: the prompts are decoded
together (in ``n_batch``-token chunks), then every step decodes one token of each sequence in one
``llama_decode`` call, as the engine's steps do. Greedy: each sequence's next token is the argmax of its logits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

N_BATCH = 512  # llama.cpp's default logical batch


def available() -> str | None:
    """None when llama-cpp-python imports, else why not."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as error:
        return f"`llama-cpp-python` is not installed ({error})"
    return None


def version() -> str:
    import llama_cpp

    return getattr(llama_cpp, "__version__", "?")


class LlamaCpp:
    """One llama.cpp model and context for ``max_sequences`` sequences of up to ``max_length`` tokens each."""

    def __init__(self, path: str, *, max_sequences: int, max_length: int, threads: int) -> None:
        import llama_cpp as lib
        import numpy as np

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its load log goes to stderr otherwise
        self._lib, self._np = lib, np
        lib.llama_backend_init()
        self._model = lib.llama_model_load_from_file(path.encode(), lib.llama_model_default_params())
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab_size = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))
        params = lib.llama_context_default_params()
        params.n_ctx = max_sequences * max_length + 64
        params.n_batch = params.n_ubatch = N_BATCH
        params.n_seq_max = max_sequences
        params.kv_unified = True  # the sequences share one cache, each attends to its own tokens only
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        self._ctx = lib.llama_init_from_model(self._model, params)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise RuntimeError("llama.cpp could not create a context")
        self._memory = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(N_BATCH, 0, 1)
        self.max_sequences = max_sequences

    def generate(self, prompts: Sequence[Sequence[int]], output_len: int, *, batched: bool) -> int:
        """Greedy ``output_len`` tokens for every prompt (no stop token); returns the tokens generated.

        ``batched``: all sequences in one batch per step; else one sequence after another."""
        if batched:
            return self._generate_together(prompts, output_len)
        return sum(self._generate_together([prompt], output_len) for prompt in prompts)

    def _generate_together(self, prompts: Sequence[Sequence[int]], output_len: int) -> int:
        if len(prompts) > self.max_sequences:
            raise ValueError(f"{len(prompts)} sequences for a context of {self.max_sequences}")
        self._lib.llama_memory_clear(self._memory, True)  # no prefix reuse between runs
        tokens = [
            (token, position, seq, position == len(prompt) - 1)
            for seq, prompt in enumerate(prompts)
            for position, token in enumerate(prompt)
        ]
        last: dict[int, int] = {}
        for start in range(0, len(tokens), N_BATCH):
            chunk = tokens[start : start + N_BATCH]
            for seq, token in zip((s for _, _, s, out in chunk if out), self._decode(chunk)):
                last[seq] = token
        lengths = [len(prompt) for prompt in prompts]
        produced = len(last)
        for step in range(1, output_len):
            chunk = [(last[seq], lengths[seq] + step - 1, seq, True) for seq in range(len(prompts))]
            for seq, token in enumerate(self._decode(chunk)):
                last[seq] = token
            produced += len(prompts)
        return produced

    def _decode(self, chunk: list[tuple[int, int, int, bool]]) -> list[int]:
        """Decode one batch of (token, position, sequence, wants logits); the argmax of every output row."""
        batch = self._batch
        for i, (token, position, seq, wants) in enumerate(chunk):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = wants
        batch.n_tokens = len(chunk)
        status = self._lib.llama_decode(self._ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        rows = sum(1 for *_, wants in chunk if wants)
        if rows == 0:
            return []
        logits = self._np.ctypeslib.as_array(
            self._lib.llama_get_logits(self._ctx), shape=(rows, self.vocab_size)
        )
        return logits.argmax(axis=1).tolist()

    def close(self) -> None:
        lib = self._lib
        if self._ctx:
            lib.llama_batch_free(self._batch)
            lib.llama_free(self._ctx)
            lib.llama_model_free(self._model)
            self._ctx = None

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
