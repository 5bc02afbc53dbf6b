"""The grammar backends' view of our tokenizers (``model/text/vocabulary.py``): a Hugging Face folder's, a GGUF
file's (byte-level BPE and SentencePiece) and the built-in one; and constrained generation on a tiny model
loaded from a Hugging Face folder and from a GGUF file, with both backends."""

import re

import pytest
import torch

import gguf_files
from enginekit import Engine, SamplingParams, StructuredOutputsParams
from enginekit.core.structured.manager import load_backend
from enginekit.model.formats.gguf_tokenizer import tokenizer_from_gguf
from enginekit.model.loader import load_model_spec
from enginekit.model.text.tokenizer import ByteTokenizer, HFTokenizer
from enginekit.model.text.vocabulary import bad_words_token_ids, build_vocabulary
from hf_checkpoints import build_checkpoint

TEXTS = ["The engine reads a prompt.", "def add(a, b):\n    return a + b", "Café 東京 42, ok?"]
REGEX = r"[a-z]{2,6}( [a-z]{2,6}){1,3}\."


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured-models")
    hf_folder = build_checkpoint(root / "hf", "llama", vocab_size=400)  # 16 logits past the tokenizer's ids
    gguf_path = root / "tiny.gguf"
    gguf_files.write_tiny_gguf(gguf_path)
    return {"hf": str(hf_folder), "gguf": str(gguf_path)}


def gguf_tokenizer(path):
    backend, info = tokenizer_from_gguf(path)
    return HFTokenizer(backend, bos_token_id=info.bos_token_id, eos_token_id=info.eos_token_id)


@pytest.fixture(scope="module")
def tokenizers(models, tmp_path_factory):
    sentencepiece = gguf_files.write_sentencepiece_gguf(tmp_path_factory.mktemp("sp") / "sp.gguf")
    return {
        "hf": load_model_spec(models["hf"]).tokenizer,
        "gguf byte-level": gguf_tokenizer(models["gguf"]),
        "gguf sentencepiece": gguf_tokenizer(sentencepiece),
        "builtin": ByteTokenizer(),
    }


@pytest.mark.parametrize("name", ["hf", "gguf byte-level", "gguf sentencepiece", "builtin"])
def test_token_bytes_spell_the_decoded_text(tokenizers, name):
    tokenizer = tokenizers[name]
    vocabulary = build_vocabulary(tokenizer, tokenizer.vocab_size + 7)
    assert vocabulary.size == tokenizer.vocab_size + 7
    assert all(i in vocabulary.special_ids for i in range(tokenizer.vocab_size, vocabulary.size))
    assert tokenizer.special_token_ids <= vocabulary.special_ids
    for text in TEXTS:
        ids = tokenizer.encode("x " + text, add_special_tokens=False)
        # After a leading token, the bytes of the rest are exactly what decoding adds.
        expected = tokenizer.decode(ids)[len(tokenizer.decode(ids[:1])) :].encode()
        assert b"".join(vocabulary.token_bytes[i] for i in ids[1:]) == expected


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("name", ["hf", "gguf byte-level", "gguf sentencepiece", "builtin"])
def test_each_backend_leads_to_a_text_through_its_masks(tokenizers, name, backend):
    """Take, step by step, the longest allowed token that spells the text on: the masks must allow the text
    through to its end, never a special token, and end the grammar at the end-of-sequence token."""
    tokenizer = tokenizers[name]
    vocabulary = build_vocabulary(tokenizer, tokenizer.vocab_size)
    eos = [tokenizer.eos_token_id]
    grammar = load_backend(backend, tokenizer, vocabulary.size, eos)
    matcher = grammar.matcher(grammar.compile("regex", r"def [a-z]+\([a-z, ]*\): return [0-9]+", True))
    rest = b"def add(a, b): return 42"
    while rest:
        bits = torch.empty((1, (vocabulary.size + 31) // 32), dtype=torch.int32)
        grammar.fill_bitmask([matcher], bits)
        allowed = {t for t in range(vocabulary.size) if (int(bits[0, t // 32]) >> (t % 32)) & 1}
        assert not allowed & (vocabulary.special_ids - set(eos))
        spelling = [
            t for t in allowed if vocabulary.token_bytes[t] and rest.startswith(vocabulary.token_bytes[t])
        ]
        assert spelling, f"no allowed token spells {rest!r}"
        token = max(spelling, key=lambda t: len(vocabulary.token_bytes[t]))
        assert matcher.accept(token)
        rest = rest[len(vocabulary.token_bytes[token]) :]
    assert not matcher.is_terminated()  # more digits may follow
    assert matcher.accept(eos[0]) and matcher.is_terminated()


def test_bad_words_are_tokenized_as_they_start_the_text_and_inside_it(tokenizers):
    tokenizer = tokenizers["hf"]
    plain = tokenizer.encode("engine", add_special_tokens=False)
    spaced = tokenizer.encode(" engine", add_special_tokens=False)
    expected = [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
    assert bad_words_token_ids(tokenizer, ("engine",)) == expected
    assert bad_words_token_ids(ByteTokenizer(), (" ab",)) == [[100, 101]]  # " ab" is longer: not added


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_constrained_generation_on_a_loaded_model(models, source):
    params = [
        SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputsParams(regex=REGEX)),
        SamplingParams(
            max_tokens=40,
            temperature=0.8,
            seed=3,
            structured_outputs=StructuredOutputsParams(choice=["cat", "dog"]),
        ),
    ]
    results = []
    for backend in ("llguidance", "xgrammar"):
        with Engine(models[source], mode="inproc", structured_outputs_backend=backend) as engine:
            outs = [o.outputs[0] for o in engine.generate(["one", "two"], params)]
        assert re.fullmatch(REGEX, outs[0].text) and outs[0].finish_reason == "stop"
        assert outs[1].text in ("cat", "dog")
        results.append(outs[0].token_ids)
    # Where the constraint forces no text, both backends allow the same tokens. (Text it forces, such as the
    # "og" after "d" of "dog", llguidance allows only as the tokenizer spells it; xgrammar in any spelling.)
    assert results[0] == results[1]
