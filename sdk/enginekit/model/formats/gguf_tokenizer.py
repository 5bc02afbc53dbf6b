"""Build a ``tokenizers.Tokenizer`` from the vocabulary a GGUF file carries in its ``tokenizer.ggml.*`` metadata.

Two tokenizer models are supported, built the way transformers' GGUF loader builds them (the reference the tests
compare against):

* ``gpt2``: byte-level BPE over the file's tokens and merges; ``tokenizer.ggml.pre`` names the split regex.
* ``llama``: SentencePiece-style BPE with byte fallback; the merges are derived from the token scores.

Where transformers and llama.cpp (which wrote the file) disagree, we follow llama.cpp: ``smollm`` splits digits
one by one, and the Llama-3 and Tekken families take a whole pre-token when the vocabulary has it
(``ignore_merges``) and add BOS unless the file says otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from enginekit.model.formats.gguf_header import GGUFHeader, gguf_error, read_gguf_header

if TYPE_CHECKING:
    from gguf import GGUFReader


_CONTROL, _USER_DEFINED = 3, 4
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class GGUFTokenizerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a GGUF file says about its tokenizer beyond the vocabulary."""

    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    bos_token: str | None  # the texts of the ids above, for chat templates
    eos_token: str | None
    chat_template: str | None


class _PreTokenizer(NamedTuple):
    split: str | None  # None: the GPT-2 regex built into the byte-level pre-tokenizer
    individual_digits: bool = False
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


_GPT2 = _PreTokenizer(None)
_LLAMA3 = _PreTokenizer(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
_QWEN2 = _PreTokenizer(_QWEN2_SPLIT)
PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "default": _GPT2,
    "gpt2": _GPT2,
    "smollm": _PreTokenizer(None, individual_digits=True),
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "tekken": _PreTokenizer(_TEKKEN_SPLIT, ignore_merges=True, add_bos=True),
}


def tokenizer_from_gguf(source: Path | str | GGUFHeader | GGUFReader) -> tuple[Tokenizer, GGUFTokenizerInfo]:
    """Build the tokenizer a GGUF file describes.

    Parameters
    ----------
    source
        The ``.gguf`` file, its parsed header, or a ``gguf.GGUFReader`` over it.

    Returns
    -------
    tuple[Tokenizer, GGUFTokenizerInfo]
        The tokenizer, with control tokens registered as special (never split) and a post-processor that adds
        BOS/EOS when the file asks for it; and the special ids, those flags and the chat template.

    Raises
    ------
    EngineStartupError
        The tokenizer model or pre-tokenizer is not supported, or a ``tokenizer.ggml.*`` key is missing.
    """
    path, meta = _metadata(source)
    tokens: list[str] = _required(path, meta, "tokenizer.ggml.tokens")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tokenizer, default_add_bos = _vocabulary_model(path, meta, tokens, token_types)
    _register_special_tokens(tokenizer, tokens, token_types)
    info = _info(meta, tokens, default_add_bos)
    tokenizer.post_processor = _post_processor(info)
    return tokenizer, info


def _vocabulary_model(
    path: Path, meta: dict[str, Any], tokens: list[str], token_types: list[int]
) -> tuple[Tokenizer, bool]:
    """The tokenizer for ``tokenizer.ggml.model``, and whether it adds BOS when the file does not say."""
    model = _required(path, meta, "tokenizer.ggml.model")
    if model == "gpt2":
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            supported = ", ".join(sorted(PRE_TOKENIZERS))
            raise gguf_error(path, f"unsupported pre-tokenizer {pre!r}; supported: {supported}")
        special = {i for i, kind in enumerate(token_types) if kind in (_CONTROL, _USER_DEFINED)}
        merges = _required(path, meta, "tokenizer.ggml.merges")
        return _byte_level_bpe(tokens, merges, special, PRE_TOKENIZERS[pre]), PRE_TOKENIZERS[pre].add_bos
    if model == "llama":
        prefix_space = meta.get("tokenizer.ggml.add_space_prefix", True)
        unk_id = meta.get("tokenizer.ggml.unknown_token_id")
        scores = _required(path, meta, "tokenizer.ggml.scores")
        return _sentencepiece_bpe(tokens, scores, unk_id, prefix_space), True
    raise gguf_error(
        path,
        f"unsupported tokenizer model {model!r}; supported: gpt2 (byte-level BPE), llama (SentencePiece)",
    )


def _required(path: Path, meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise gguf_error(path, f"missing tokenizer metadata key {key!r}")
    return meta[key]


def _metadata(source: Path | str | GGUFHeader | GGUFReader) -> tuple[Path, dict[str, Any]]:
    if isinstance(source, GGUFHeader):
        return source.path, source.metadata
    if isinstance(source, (str, Path)):
        header = read_gguf_header(Path(source))
        return header.path, header.metadata
    path = Path(getattr(source.data, "filename", None) or "<GGUFReader>")
    return path, {name: field.contents() for name, field in source.fields.items()}


def _byte_level_bpe(
    tokens: list[str], merges: list[str], special: set[int], spec: _PreTokenizer
) -> Tokenizer:
    spelling = _byte_spelling()
    alphabet = set(spelling.values())

    def spelled(index: int, token: str) -> str:
        # A normal token written as raw text (not in the byte alphabet) is respelled so BPE can produce it.
        if index in special or set(token) <= alphabet:
            return token
        return "".join(spelling[byte] for byte in token.encode("utf-8"))

    vocab = {spelled(index, token): index for index, token in enumerate(tokens)}
    pairs = [(left, right) for left, right in (merge.split(" ", 1) for merge in merges)]
    tokenizer = Tokenizer(models.BPE(vocab, pairs, ignore_merges=spec.ignore_merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=spec.split is None)
    steps: list[pre_tokenizers.PreTokenizer] = (
        [byte_level]
        if spec.split is None
        else [pre_tokenizers.Split(Regex(spec.split), "isolated"), byte_level]
    )
    if spec.individual_digits:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tokenizer.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(
    tokens: list[str], scores: list[float], unk_id: int | None, prefix_space: bool
) -> Tokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_token = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    bpe = models.BPE(
        vocab, _merges_from_scores(vocab, scores), unk_token=unk_token, fuse_unk=True, byte_fallback=True
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens is a merge, ranked by the merged token's score, best first.

    SentencePiece BPE files keep scores instead of merges; ties go to the longer left piece, then the longer
    right piece, then the lower ids, the order the reference converter produces.
    """
    candidates = []
    for token, index in vocab.items():
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        found = sorted(
            (vocab[left], vocab[right], left, right)
            for left, right in splits
            if left in vocab and right in vocab
        )
        candidates += [(scores[index], left, right) for _, _, left, right in found]
    candidates.sort(key=lambda merge: (merge[0], len(merge[1]), len(merge[2])), reverse=True)
    return [(left, right) for _, left, right in candidates]


def _register_special_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens: both are never split."""
    control = [tokens[i] for i, kind in enumerate(token_types) if kind == _CONTROL]
    user_defined = [tokens[i] for i, kind in enumerate(token_types) if kind == _USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in control])
    tokenizer.add_tokens([AddedToken(text, special=False, normalized=False) for text in user_defined])


def _info(meta: dict[str, Any], tokens: list[str], default_add_bos: bool) -> GGUFTokenizerInfo:
    def token_id(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return value if isinstance(value, int) and 0 <= value < len(tokens) else None

    bos_id, eos_id = token_id("bos_token_id"), token_id("eos_token_id")
    return GGUFTokenizerInfo(
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=token_id("padding_token_id"),
        unk_token_id=token_id("unknown_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos)) and bos_id is not None,
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None,
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_id] if eos_id is not None else None,
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _post_processor(info: GGUFTokenizerInfo) -> processors.TemplateProcessing:
    # A template names its special tokens in "text:type" pieces, so a token text with a colon gets a stand-in.
    bos = (
        [(info.bos_token if ":" not in info.bos_token else "[BOS]", info.bos_token_id)]
        if info.add_bos_token and info.bos_token is not None  # add_bos_token implies a bos token
        else []
    )
    eos = (
        [(info.eos_token if ":" not in info.eos_token else "[EOS]", info.eos_token_id)]
        if info.add_eos_token and info.eos_token is not None
        else []
    )
    single = [name for name, _ in bos] + ["$A"] + [name for name, _ in eos]
    pair = [*single, *(f"{name}:1" for name, _ in bos), "$B:1", *(f"{name}:1" for name, _ in eos)]
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict(bos + eos).items())
    )


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest map to code points from 256."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), 256),
    ]
    unprintable = [byte for byte in range(256) if byte not in printable]
    return {**{byte: chr(byte) for byte in printable}, **{b: chr(256 + n) for n, b in enumerate(unprintable)}}
