"""The bytes each token id stands for: what a grammar backend needs to know of our tokenizer.

A token's bytes are what it adds to the text in the middle of a sequence: a byte-level BPE token (GPT-2's
alphabet, ``Ġ`` for a space) spelled back into bytes, a SentencePiece piece with ``▁`` as a space and its byte
tokens (``<0x0A>``) as the byte, the built-in tokenizer's one byte. Special tokens (control tokens such as
``<|im_end|>``) stand for no text: a grammar never produces them, only the end of sequence.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from enginekit.model.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class Vocabulary:
    """Every token id's bytes (``token_bytes[i]``; ``len`` is the model's vocabulary size, the logits' width),
    and which ids are special (no text; the ids past the tokenizer's vocabulary are special too)."""

    token_bytes: list[bytes]
    special_ids: frozenset[int]

    @property
    def size(self) -> int:
        return len(self.token_bytes)


def build_vocabulary(tokenizer: Tokenizer, vocab_size: int) -> Vocabulary:
    """The vocabulary of ``tokenizer`` as a model with ``vocab_size`` logits sees it."""
    if isinstance(tokenizer, ByteTokenizer):
        pieces = [b""] * ByteTokenizer.NUM_SPECIAL + [bytes([b]) for b in range(256)]
        specials = set(range(ByteTokenizer.NUM_SPECIAL))
    elif isinstance(tokenizer, HFTokenizer):
        pieces, specials = _hf_pieces(tokenizer)
    else:
        raise TypeError(f"no vocabulary for a {type(tokenizer).__name__}")
    pieces = pieces[:vocab_size] + [b""] * (vocab_size - len(pieces))
    specials |= {i for i in range(len(pieces)) if not pieces[i]}
    return Vocabulary(pieces, frozenset(i for i in specials if i < vocab_size))


def _hf_pieces(tokenizer: HFTokenizer) -> tuple[list[bytes], set[int]]:
    backend = tokenizer.backend
    vocab = backend.get_vocab(with_added_tokens=True)
    specials = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
    described = json.loads(backend.to_str())
    unknown = (described.get("model") or {}).get("unk_token")
    if isinstance(unknown, str) and unknown in vocab:
        specials.add(vocab[unknown])  # <unk> stands for text the tokenizer could not spell, not for its name
    decoder = described.get("decoder") or {}
    kinds = {step.get("type") for step in decoder.get("decoders", [decoder])}
    spell = _byte_level if "ByteLevel" in kinds else _sentencepiece if "ByteFallback" in kinds else _raw
    if spell is _raw and any(step.get("content") == " " for step in decoder.get("decoders", [])):
        spell = _sentencepiece  # a Metaspace-style decoder (Replace "▁" by " ") without byte tokens
    pieces = [b""] * (max(vocab.values(), default=-1) + 1)
    for token, index in vocab.items():
        pieces[index] = b"" if index in specials else spell(token)
    return pieces, specials


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: printable bytes stand for themselves, the rest for 256+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 256)]
    unprintable = [byte for byte in range(256) if byte not in printable]
    return {**{chr(byte): byte for byte in printable}, **{chr(256 + n): b for n, b in enumerate(unprintable)}}


def _byte_level(token: str) -> bytes:
    table = _byte_decoder()
    if all(char in table for char in token):
        return bytes(table[char] for char in token)
    return token.encode("utf-8")  # an added token written as plain text (``<think>``)


def _sentencepiece(token: str) -> bytes:
    match = _BYTE_TOKEN.fullmatch(token)
    if match:
        return bytes([int(match.group(1), 16)])
    return token.replace("\u2581", " ").encode("utf-8")


def _raw(token: str) -> bytes:
    return token.encode("utf-8")


def bad_words_token_ids(tokenizer: Tokenizer, words: tuple[str, ...]) -> list[list[int]]:
    """The token sequences of ``bad_words`` (vLLM's definition): each word as it starts the text, and after a
    space when that spells it with another first token and as many tokens (a word inside the text)."""
    sequences = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return [sequence for sequence in sequences if sequence]
