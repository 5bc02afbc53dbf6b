"""The llguidance backend hands llguidance a raw pointer into the step's bitmask: every property llguidance relies
on (a CPU tensor of int32 words, exactly one row of the vocabulary's words per matcher, rows one after another) is
checked with a real exception before the pointer is used, also under ``python -O``, which removes asserts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from enginekit import StructuredOutputsParams
from enginekit.core.structured.llguidance_backend import LLGuidanceBackend
from enginekit.model.text.tokenizer import ByteTokenizer

WORDS = 9  # (259 tokens + 31) // 32
SENTINEL = 0x5A5A5A5A


def int32(*shape: int) -> torch.Tensor:
    return torch.full(shape, SENTINEL, dtype=torch.int32)


BAD = [
    ("a list", lambda: [[0] * WORDS] * 2, TypeError, r"^the bitmask must be a torch.Tensor, got list$"),
    ("int64 words", lambda: int32(2, WORDS).long(), TypeError, r"must hold int32 words, got torch.int64$"),
    ("too few words", lambda: int32(2, WORDS - 1), ValueError, r"must be \[rows, 9\] .*, got \[2, 8\]$"),
    ("too many words", lambda: int32(2, WORDS + 1), ValueError, r"must be \[rows, 9\] .*, got \[2, 10\]$"),
    ("one dimension", lambda: int32(2 * WORDS), ValueError, r"must be \[rows, 9\] .*, got \[18\]$"),
    ("too few rows", lambda: int32(1, WORDS), ValueError, r"^the bitmask has 1 rows for 2 matchers$"),
    ("transposed", lambda: int32(WORDS, 2).t(), ValueError, r"must be contiguous"),
    ("every other column", lambda: int32(2, 2 * WORDS)[:, ::2], ValueError, r"must be contiguous"),
    (
        "not in CPU memory",
        lambda: torch.zeros(2, WORDS, dtype=torch.int32, device="meta"),
        ValueError,
        r"must be in CPU memory .*, got meta$",
    ),
]


def backend_and_matchers() -> tuple[LLGuidanceBackend, list]:
    tokenizer = ByteTokenizer()
    backend = LLGuidanceBackend(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id])
    compiled = backend.compile(*StructuredOutputsParams(regex="[a-c]+").spec)
    return backend, [backend.matcher(compiled) for _ in range(2)]


def check_every_bad_bitmask() -> int:
    """Each bad bitmask raises its exception, and llguidance wrote nothing; returns how many were checked."""
    backend, matchers = backend_and_matchers()
    for name, make, exception, message in BAD:
        bitmask = make()
        with pytest.raises(exception, match=message):
            backend.fill_bitmask(matchers, bitmask)
        if isinstance(bitmask, torch.Tensor) and bitmask.device.type == "cpu":
            assert bool((bitmask == SENTINEL).all()), (
                f"{name}: llguidance wrote into a bitmask it was refused"
            )
    with pytest.raises(TypeError, match=r"^matcher 1 is a str, not one this backend made$"):
        backend.fill_bitmask([matchers[0], "matcher"], int32(2, WORDS))
    return len(BAD) + 1


@pytest.mark.parametrize(("name", "make", "exception", "message"), BAD, ids=[case[0] for case in BAD])
def test_a_bad_bitmask_is_refused_before_llguidance_writes_into_it(name, make, exception, message):
    backend, matchers = backend_and_matchers()
    bitmask = make()
    with pytest.raises(exception, match=message):
        backend.fill_bitmask(matchers, bitmask)


def test_a_good_bitmask_is_filled_row_by_row():
    backend, matchers = backend_and_matchers()
    bitmask = int32(3, WORDS)  # a spare row stays as it was
    backend.fill_bitmask(matchers, bitmask)
    allowed = {t for t in range(259) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1}
    assert allowed == {ord(c) + ByteTokenizer.NUM_SPECIAL for c in "abc"}
    assert torch.equal(bitmask[0], bitmask[1]) and bool((bitmask[2] == SENTINEL).all())


def test_the_checks_hold_under_python_O():
    script = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "if __debug__: raise SystemExit('asserts are on: not running under -O')\n"
        "import test_structured_bitmask as checks\n"
        "print('checked', checks.check_every_bad_bitmask())\n"
    )
    done = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["checked", str(len(BAD) + 1)]
