from enginekit.core.detokenizer import IncrementalDetokenizer
from enginekit.model.text.tokenizer import ByteTokenizer


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
