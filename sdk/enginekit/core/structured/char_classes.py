"""The characters a one-character regex matches, as llguidance reads it: the reference for what a class means.

The regex syntax the API documents is Rust's (llguidance's): Unicode ``\\d`` and ``\\w``, ``\\p{Greek}``, POSIX
classes (``[[:alpha:]]``), nested classes and their set operations (``[a-z&&[^aeiou]]``), case folding under
``(?i)``. Rather than a second copy of those rules and of the Unicode tables, a class is asked of llguidance
itself: a matcher over a tokenizer of single bytes, walked through every UTF-8 byte sequence the class allows,
gives its code points exactly. A class is resolved once per process (cached); a negated class is resolved as
the complement of its positive form, whose walk is short.
"""

from __future__ import annotations

import functools

import llguidance
import numpy as np

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, inclusive code point ranges

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # not characters: no regex matches them, no UTF-8 text holds them
ALL: Ranges = ((0, SURROGATES[0] - 1), (SURROGATES[1] + 1, MAX_CODE_POINT))
_EOS = 256
_CONTINUATION_BITS = 0x3F


class _Bytes:
    """What ``llguidance.TokenizerWrapper`` reads: token ``b`` is byte ``b``, and one end-of-sequence token."""

    eos_token_id = _EOS
    bos_token_id = None
    special_token_ids = [_EOS]
    tokens = [bytes([byte]) for byte in range(256)] + [b"\xff<[256]>"]

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("the wrapper takes text")
        return list(text.encode())


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), n_vocab=_EOS + 1, eos_token=[_EOS])


def complement(ranges: Ranges) -> Ranges:
    """Every character not in ``ranges``."""
    result, start = [], 0
    for low, high in ranges:
        if low > start:
            result.append((start, low - 1))
        start = max(start, high + 1)
    if start <= MAX_CODE_POINT:
        result.append((start, MAX_CODE_POINT))
    return intersect(tuple(result), ALL)


def intersect(first: Ranges, second: Ranges) -> Ranges:
    result, i, j = [], 0, 0
    while i < len(first) and j < len(second):
        low, high = max(first[i][0], second[j][0]), min(first[i][1], second[j][1])
        if low <= high:
            result.append((low, high))
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return tuple(result)


def subtract(ranges: Ranges, removed: Ranges) -> Ranges:
    return intersect(ranges, complement(removed))


def of_code_points(points: list[int]) -> Ranges:
    merged: list[list[int]] = []
    for point in sorted(set(points)):
        if merged and merged[-1][1] == point - 1:
            merged[-1][1] = point
        else:
            merged.append([point, point])
    return tuple((low, high) for low, high in merged)


@functools.lru_cache(maxsize=1024)
def class_ranges(atom: str, flags: str = "") -> Ranges:
    """The code points the one-character regex ``atom`` matches under the inline ``flags`` (``"i"``, ``"x"``)
    in Rust's syntax; ``ValueError`` if llguidance does not take it."""
    positive = _positive_form(atom)
    if positive is not None:
        return complement(class_ranges(positive, flags))
    regex = f"(?{flags}:{atom})" if flags else atom
    try:
        matcher = llguidance.LLMatcher(
            _byte_tokenizer(), llguidance.grammar_from("regex", regex), log_level=0
        )
    except ValueError as error:
        raise ValueError(f"{atom!r} is not a character class: {error}") from None
    if matcher.is_error():
        raise ValueError(f"{atom!r} is not a character class: {matcher.get_error().strip()}")
    points: list[int] = []
    _walk(matcher, 0, 0, points)
    return of_code_points(points)


def _positive_form(atom: str) -> str | None:
    """The class ``atom`` negates (``[^a]`` -> ``[a]``, ``\\D`` -> ``\\d``, ``\\P{L}`` -> ``\\p{L}``), if it is
    a negation: its complement is resolved instead, as a negated class's walk visits most of Unicode."""
    if atom.startswith("[^") and atom.endswith("]"):
        return "[" + atom[2:]
    if len(atom) >= 2 and atom[0] == "\\" and atom[1] in "DWSP":
        return "\\" + atom[1].lower() + atom[2:]
    return None


def _walk(matcher: llguidance.LLMatcher, prefix: int, remaining: int, points: list[int]) -> None:
    """Collect the code points the matcher allows from here: ``remaining`` continuation bytes are still to
    come after the bits ``prefix`` of a character begun (0: at a character's first byte)."""
    for byte in _allowed_bytes(matcher):
        if remaining == 0:
            if byte < 0x80:
                points.append(byte)
                continue
            length = 1 if byte < 0xE0 else 2 if byte < 0xF0 else 3
            lead_bits = byte & (0x1F, 0x0F, 0x07)[length - 1]
            _descend(matcher, byte, lead_bits, length, points)
        elif remaining == 1:
            points.append((prefix << 6) | (byte & _CONTINUATION_BITS))
        else:
            _descend(matcher, byte, (prefix << 6) | (byte & _CONTINUATION_BITS), remaining - 1, points)


def _descend(
    matcher: llguidance.LLMatcher, byte: int, prefix: int, remaining: int, points: list[int]
) -> None:
    if not matcher.consume_token(byte):
        raise RuntimeError(f"llguidance refused byte {byte:#x} its own mask allowed")
    _walk(matcher, prefix, remaining, points)
    matcher.rollback(1)


def _allowed_bytes(matcher: llguidance.LLMatcher) -> list[int]:
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return [int(byte) for byte in np.flatnonzero(bits[:_EOS])]
