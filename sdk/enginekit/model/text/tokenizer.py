"""Tokenizers: the built-in byte-level one, and any ``tokenizers.Tokenizer`` (from tokenizer.json or a GGUF)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as RustTokenizer

from enginekit.errors import EngineStartupError


class Tokenizer(Protocol):
    # Read-only: a tokenizer may fix them as class constants (ByteTokenizer's are plain ints).
    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def special_token_ids(self) -> frozenset[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """Every UTF-8 byte is one token, after three special tokens: pad 0, bos 1, eos 2."""

    NUM_SPECIAL = 3
    SPECIAL_TEXT = ("<pad>", "<s>", "</s>")
    vocab_size = 256 + NUM_SPECIAL
    bos_token_id = 1
    eos_token_id = 2
    special_token_ids = frozenset(range(NUM_SPECIAL))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + self.NUM_SPECIAL for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens or not any(t < self.NUM_SPECIAL for t in token_ids):
            data = bytes(t - self.NUM_SPECIAL for t in token_ids if t >= self.NUM_SPECIAL and t < 259)
            return data.decode("utf-8", errors="replace")
        pieces, run = [], []
        for token in token_ids:
            if token < self.NUM_SPECIAL:
                pieces += [self.decode(run), self.SPECIAL_TEXT[token]]
                run = []
            else:
                run.append(token)
        return "".join([*pieces, self.decode(run)])


class HFTokenizer:
    """A ``tokenizers.Tokenizer``: ``encode`` adds the model's special tokens, ``decode`` drops them (unless told
    not to).

    ``backend`` is the ``tokenizers.Tokenizer`` itself, for what this small interface does not cover.
    """

    def __init__(self, backend: RustTokenizer, *, bos_token_id: int | None, eos_token_id: int | None) -> None:
        self.backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        added = backend.get_added_tokens_decoder()
        self.special_token_ids = frozenset(i for i, token in added.items() if token.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(
    folder: Path, *, bos_token_id: int | None = None, eos_token_id: int | None = None
) -> HFTokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise EngineStartupError(f"model folder {folder} has no tokenizer.json", phase="model load")
    try:
        backend = RustTokenizer.from_file(str(path))
    except Exception as error:
        raise EngineStartupError(f"cannot read {path}: {error}", phase="model load") from error
    return HFTokenizer(backend, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
