"""StructuredOutputManager: compiles each request's constraint off the step loop, and fills each step's bitmask.

A constraint is compiled once per engine and cached by its spec (kind, text, whitespace), least recently used
dropped past ``MAX_CACHED``; a failed compile is cached too, so the same mistake fails at once. Compiling runs on
one worker thread (both backends release the GIL while they compile), so a request waits for its grammar in
the waiting queue while the batch goes on without it. The backend and its view of the vocabulary are built on
the first constraint, not at startup: an engine that never sees one pays nothing.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from enginekit.core.structured.backend import GrammarBackend, GrammarMatcher, bitmask_words
from enginekit.model.text.tokenizer import Tokenizer
from enginekit.model.text.vocabulary import build_vocabulary
from enginekit.structured_outputs import GrammarKind, StructuredOutputsParams

MAX_CACHED = 256

Spec = tuple[GrammarKind, str, bool]


def load_backend(
    name: str, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]
) -> GrammarBackend[Any]:
    """The backend ``name`` for a model with this tokenizer and ``vocab_size`` logits (imports the backend's
    package now; ``EngineConfig`` checked it is installed)."""
    if name == "xgrammar":
        from enginekit.core.structured.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(build_vocabulary(tokenizer, vocab_size), eos_token_ids)
    from enginekit.core.structured.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids)


class RequestGrammar:
    """One request's grammar: compiling until ``matcher`` is set (or ``error``, if it does not compile)."""

    __slots__ = ("error", "future", "matcher")

    def __init__(self, future: concurrent.futures.Future[Any]) -> None:
        self.future = future
        self.matcher: GrammarMatcher | None = None
        self.error: BaseException | None = None

    @property
    def is_ready(self) -> bool:
        return self.matcher is not None

    @property
    def ready_matcher(self) -> GrammarMatcher:
        """The matcher of a request that is scheduled (the scheduler holds back those still compiling)."""
        assert self.matcher is not None, "a request was scheduled before its grammar compiled"
        return self.matcher


class StructuredOutputManager:
    def __init__(
        self, backend_name: str, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]
    ) -> None:
        self.backend_name = backend_name
        self._make_backend: Callable[[], GrammarBackend[Any]] = lambda: load_backend(
            backend_name, tokenizer, vocab_size, list(eos_token_ids)
        )
        self._backend: GrammarBackend[Any] | None = None
        self._backend_lock = threading.Lock()
        self._words = bitmask_words(vocab_size)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._compiled: collections.OrderedDict[Spec, concurrent.futures.Future[Any]] = (
            collections.OrderedDict()
        )
        self.num_compiled = 0
        self.num_cache_hits = 0
        self.compile_seconds = 0.0
        self.backend_seconds = 0.0
        self.mask_seconds = 0.0

    # ---- compiling ----------------------------------------------------------------------------------------
    def request_grammar(self, params: StructuredOutputsParams) -> RequestGrammar:
        """The grammar of a new request: from the cache, or compiling now on the worker thread."""
        spec = params.spec
        future = self._compiled.get(spec)
        if future is not None:
            self._compiled.move_to_end(spec)
            self.num_cache_hits += 1
        else:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="enginekit-grammar")
            future = self._pool.submit(self._compile, spec)
            self._compiled[spec] = future
            while len(self._compiled) > MAX_CACHED:
                self._compiled.popitem(last=False)
        return RequestGrammar(future)

    def _compile(self, spec: Spec) -> Any:
        backend = self._get_backend()
        start = time.perf_counter()
        compiled = backend.compile(*spec)
        self.compile_seconds += time.perf_counter() - start
        self.num_compiled += 1
        return compiled

    def _get_backend(self) -> GrammarBackend[Any]:
        with self._backend_lock:
            if self._backend is None:
                start = time.perf_counter()
                self._backend = self._make_backend()
                self.backend_seconds = time.perf_counter() - start
            return self._backend

    def resolve(self, grammar: RequestGrammar) -> bool:
        """Whether the grammar's compile has ended; then its ``matcher`` (or its ``error``) is set."""
        if grammar.matcher is not None or grammar.error is not None:
            return True
        if not grammar.future.done():
            return False
        try:
            compiled = grammar.future.result()
        except Exception as error:
            grammar.error = (
                error if isinstance(error, ValueError) else ValueError(f"{type(error).__name__}: {error}")
            )
            return True
        assert self._backend is not None
        grammar.matcher = self._backend.matcher(compiled)
        return True

    @staticmethod
    def wait(grammars: list[RequestGrammar], timeout: float) -> None:
        """Block until one of these grammars is compiled, at most ``timeout`` seconds."""
        concurrent.futures.wait([g.future for g in grammars], timeout, concurrent.futures.FIRST_COMPLETED)

    # ---- each step ----------------------------------------------------------------------------------------
    def bitmask(self, matchers: list[GrammarMatcher]) -> torch.Tensor:
        """The allowed tokens of each matcher, one ``int32`` row each."""
        start = time.perf_counter()
        bits = torch.empty((len(matchers), self._words), dtype=torch.int32)
        assert self._backend is not None
        self._backend.fill_bitmask(matchers, bits)
        self.mask_seconds += time.perf_counter() - start
        return bits

    def stats(self) -> dict[str, Any]:
        return {
            "structured_outputs_backend": self.backend_name,
            "grammars_compiled": self.num_compiled,
            "grammar_cache_hits": self.num_cache_hits,
            "grammar_compile_s": self.compile_seconds,
            "grammar_backend_init_s": self.backend_seconds,
            "grammar_mask_s": self.mask_seconds,
        }

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._compiled.clear()
