"""llama.cpp as a baseline, through llama-cpp-python's low-level API: greedy decoding of several sequences in
one batch (what a llama.cpp server does with parallel slots), or one sequence at a time.

``Llama.generate`` in the high-level API decodes one sequence; several requests there run one after another.
Here one context holds up to ``max_sequences`` sequences in a unified KV cache: the prompts are decoded
together (in ``n_batch``-token chunks), then every step decodes one token of each sequence in one
``llama_decode`` call, as the engine's steps do. Greedy: each sequence's next token is the argmax of its logits.

``LlamaCppGenerate`` is the other way in: llama-cpp-python's high-level ``Llama.generate``, one sequence at a
time, optionally with its prompt lookup decoding (``LlamaPromptLookupDecoding`` as the draft model), timed from
the first generated token to the last as well as from the start.

The benchmark sections run either in a child process (``LlamaCppProcess``): llama-cpp-python built from source can
crash in native code (on Intel AMX hosts 0.3.36 segfaults at its first decode), and a crash there must cost the
run its llama.cpp figures only. A crash raises ``LlamaCppCrashed`` naming the signal; ``interleave_surviving``
then measures the other systems without it. ``python benchmarks/llama_cpp_runner.py serve ARGS`` is the child.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

N_BATCH = 512  # llama.cpp's default logical batch
REPLY_TIMEOUT_S = 600.0  # a reply slower than this is a hung child, not a slow one
# Set in the child's environment, makes it fault for real (a null-pointer read) at "start" (before llama.cpp
# loads) or at its first "decode": how the tests check that a crash costs the run only llama.cpp's figures.
FAULT_ENV = "ENGINEKIT_BENCH_LLAMA_CPP_FAULT"


def available() -> str | None:
    """None when llama-cpp-python is installed, else why not. Looked up without importing it: its native
    library is loaded in the child process only."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "`llama-cpp-python` is not installed"
    return None


def version() -> str:
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return "?"


class LlamaCppCrashed(RuntimeError):
    """llama.cpp's child process died (a signal or an exit) or stopped answering."""


class LlamaCppProcess:
    """``LlamaCpp`` in a child process: the same model and context, the same greedy decoding, timed in the child.

    Raises ``LlamaCppCrashed`` (from the constructor or ``generate``) when the child dies, and ``RuntimeError``
    when llama.cpp reports an error (a model it cannot load, a failed decode)."""

    def __init__(
        self,
        path: str,
        *,
        max_sequences: int,
        max_length: int,
        threads: int,
        reply_timeout_s: float = REPLY_TIMEOUT_S,
        kind: str = "batch",
        prompt_lookup: dict[str, int] | None = None,
    ) -> None:
        """``kind``: ``"batch"`` (``LlamaCpp``: ``generate``) or ``"generate"`` (``LlamaCppGenerate``: ``complete``,
        with ``prompt_lookup``, ``LlamaPromptLookupDecoding``'s arguments, or ``None`` for plain decoding)."""
        if kind not in ("batch", "generate"):
            raise ValueError(f"kind must be 'batch' or 'generate', got {kind!r}")
        self._timeout = reply_timeout_s
        self.kind = kind
        # llama.cpp logs its load on stderr: into a file, which cannot fill as a pipe can (closed in close())
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115
        arguments = dict(
            path=path,
            max_sequences=max_sequences,
            max_length=max_length,
            threads=threads,
            kind=kind,
            prompt_lookup=prompt_lookup,
        )
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "serve", json.dumps(arguments)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )
        self._selector = selectors.DefaultSelector()
        assert self._proc.stdout is not None
        self._selector.register(self._proc.stdout, selectors.EVENT_READ)
        self._buffer = b""
        try:
            ready = self._receive("loading the model")
        except BaseException:
            self.close()
            raise
        self.vocab_size = int(ready["vocab_size"])
        self.max_sequences = max_sequences

    def generate(
        self, prompts: Sequence[Sequence[int]], output_len: int, *, batched: bool
    ) -> tuple[int, float]:
        """``LlamaCpp.generate`` in the child: (tokens generated, seconds the child took for them)."""
        self._send(
            {
                "op": "generate",
                "prompts": [list(p) for p in prompts],
                "output_len": output_len,
                "batched": batched,
            }
        )
        reply = self._receive(f"generating for {len(prompts)} sequence(s)")
        return int(reply["tokens"]), float(reply["elapsed_s"])

    def complete(
        self, prompt: Sequence[int], max_tokens: int, stop_token_ids: Sequence[int]
    ) -> dict[str, Any]:
        """``LlamaCppGenerate.complete`` in the child (``kind="generate"``): the generated token ids, the
        seconds from the start to the last token (``elapsed_s``) and to the first (``first_token_s``)."""
        self._send(
            {
                "op": "complete",
                "prompt": list(prompt),
                "max_tokens": max_tokens,
                "stop_token_ids": list(stop_token_ids),
            }
        )
        return self._receive("generating one sequence with Llama.generate")

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.write(b'{"op": "close"}\n')
                proc.stdin.flush()
        except OSError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        self._selector.close()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
        self._stderr.close()

    def __enter__(self) -> LlamaCppProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _send(self, message: dict[str, Any]) -> None:
        proc = self._proc
        if proc is None:
            raise RuntimeError("llama.cpp's process is closed")
        try:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(message).encode() + b"\n")
            proc.stdin.flush()
        except BrokenPipeError:
            raise LlamaCppCrashed(self._death("receiving a request")) from None

    def _receive(self, doing: str) -> dict[str, Any]:
        proc = self._proc
        if proc is None:
            raise RuntimeError("llama.cpp's process is closed")
        assert proc.stdout is not None
        deadline = time.monotonic() + self._timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                proc.kill()
                proc.wait(timeout=30)
                raise LlamaCppCrashed(
                    f"llama.cpp's process did not answer within {self._timeout:.0f} s {doing}"
                )
            if not self._selector.select(min(remaining, 1.0)):
                continue
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise LlamaCppCrashed(self._death(doing))
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"llama.cpp {doing}: {reply['error']}")
        return reply

    def _death(self, doing: str) -> str:
        """How the child ended, while ``doing``, with the last line it wrote on stderr."""
        assert self._proc is not None
        try:
            code = self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            code = self._proc.wait(timeout=30)
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        self._stderr.seek(0)
        lines = [
            line.strip() for line in self._stderr.read().decode(errors="replace").splitlines() if line.strip()
        ]
        last = f"; its last stderr line: {lines[-1][:200]}" if lines else ""
        return f"llama.cpp's process (llama-cpp-python {version()}) {how} while {doing}{last}"


def interleave_surviving(
    runners: dict[str, Callable[[], Any]],
    llama_keys: Sequence[str],
    interleave: Callable[..., dict[str, list[Any]]],
    **options: Any,
) -> tuple[dict[str, list[Any]], str | None]:
    """``interleave(runners, **options)``; if a llama.cpp runner (one of ``llama_keys``) crashes, the same
    interleave again without the llama.cpp runners. Returns the samples and the crash's message (or None)."""
    try:
        return interleave(runners, **options), None
    except LlamaCppCrashed as crash:
        rest = {name: run for name, run in runners.items() if name not in llama_keys}
        return interleave(rest, **options), str(crash)


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
        vocab = lib.llama_model_get_vocab(self._model)
        if not vocab:
            lib.llama_model_free(self._model)
            raise RuntimeError(f"llama.cpp found no vocabulary in {path}")
        self.vocab_size = lib.llama_vocab_n_tokens(vocab)
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
        if os.environ.get(FAULT_ENV) == "decode":
            _fault()
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


class LlamaCppGenerate:
    """llama-cpp-python's high-level ``Llama`` on one sequence at a time, greedy; with ``prompt_lookup``
    (``{"max_ngram_size": n, "num_pred_tokens": k}``) its prompt lookup decoding proposes the tokens that followed
    the latest match of the context's last n..1 tokens, and one ``llama_decode`` verifies them."""

    def __init__(
        self, path: str, *, max_length: int, threads: int, prompt_lookup: dict[str, int] | None = None
    ) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        draft = LlamaPromptLookupDecoding(**prompt_lookup) if prompt_lookup is not None else None
        self._llm = Llama(
            model_path=path,
            n_ctx=max_length + 64,
            n_batch=N_BATCH,
            n_threads=threads,
            n_threads_batch=threads,
            draft_model=draft,
            seed=0,
            verbose=False,
        )
        self.vocab_size = self._llm.n_vocab()

    def complete(
        self, prompt: Sequence[int], max_tokens: int, stop_token_ids: Sequence[int]
    ) -> dict[str, Any]:
        """Greedy tokens after ``prompt`` until a stop token (left out) or ``max_tokens``, with no prefix reused
        from the previous call; the seconds to the first and to the last token."""
        if os.environ.get(FAULT_ENV) == "decode":
            _fault()
        self._llm.reset()
        stops = set(stop_token_ids)
        tokens: list[int] = []
        start = time.perf_counter()
        first = elapsed = 0.0
        for token in self._llm.generate(list(prompt), temp=0.0, repeat_penalty=1.0, reset=True):
            if not tokens:
                first = time.perf_counter() - start
            if token in stops:
                break
            tokens.append(int(token))
            elapsed = time.perf_counter() - start
            if len(tokens) >= max_tokens:
                break
        return {"token_ids": tokens, "elapsed_s": elapsed, "first_token_s": first}

    def close(self) -> None:
        self._llm.close()


def _fault() -> None:
    """A real segmentation fault: a read at address 0."""
    import ctypes

    ctypes.string_at(0)


def serve(arguments: dict[str, Any]) -> int:
    """The child: load the model, then answer one JSON line per request line on stdin. Its stdout carries only
    the replies (anything native code prints goes to stderr)."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    if os.environ.get(FAULT_ENV) == "start":
        _fault()
    llm: LlamaCpp | LlamaCppGenerate
    try:
        if arguments.get("kind", "batch") == "generate":
            llm = LlamaCppGenerate(
                arguments["path"],
                max_length=arguments["max_length"],
                threads=arguments["threads"],
                prompt_lookup=arguments.get("prompt_lookup"),
            )
        else:
            llm = LlamaCpp(
                arguments["path"],
                max_sequences=arguments["max_sequences"],
                max_length=arguments["max_length"],
                threads=arguments["threads"],
            )
    except Exception as error:
        replies.write(json.dumps({"error": f"{type(error).__name__}: {error}"}) + "\n")
        return 1
    replies.write(json.dumps({"ready": True, "vocab_size": llm.vocab_size}) + "\n")
    try:
        for line in sys.stdin:
            request = json.loads(line)
            if request["op"] == "close":
                break
            try:
                reply: dict[str, Any]
                if request["op"] == "complete" and isinstance(llm, LlamaCppGenerate):
                    reply = llm.complete(request["prompt"], request["max_tokens"], request["stop_token_ids"])
                elif request["op"] == "generate" and isinstance(llm, LlamaCpp):
                    start = time.perf_counter()
                    tokens = llm.generate(
                        request["prompts"], request["output_len"], batched=request["batched"]
                    )
                    reply = {"tokens": tokens, "elapsed_s": time.perf_counter() - start}
                else:
                    reply = {"error": f"op {request['op']!r} is not served by {type(llm).__name__}"}
            except Exception as error:
                reply = {"error": f"{type(error).__name__}: {error}"}
            replies.write(json.dumps(reply) + "\n")
    finally:
        llm.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "serve":
        sys.exit('usage: llama_cpp_runner.py serve \'{"path": ..., "max_sequences": ..., ...}\'')
    sys.exit(serve(json.loads(sys.argv[2])))
