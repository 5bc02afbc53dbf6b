import pytest

from enginekit import Engine, EngineConfig
from enginekit.config import resolve_mode


def test_unknown_option_names_the_closest():
    with pytest.raises(
        TypeError, match=r"unknown engine option 'max_num_seq'; did you mean 'max_num_seqs'\?"
    ):
        EngineConfig.from_options(None, max_num_seq=4)


def test_engine_rejects_unknown_option_before_starting():
    with pytest.raises(TypeError, match="did you mean 'block_size'"):
        Engine("builtin", mode="inproc", blok_size=16)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"block_size": 12}, "block_size must be a positive power of two"),
        ({"max_num_seqs": 0}, "max_num_seqs must be at least 1"),
        ({"num_kv_blocks": 1}, "num_kv_blocks must be at least 2"),
        ({"stream_interval": 0}, "stream_interval must be at least 1, got 0"),
        ({"address": "http://x"}, "address must start with tcp:// or ipc://"),
        ({"device": "tpu"}, "device must be 'cpu', 'cuda' or 'cuda:N'"),
        (
            {"dtype": "float8"},
            "engine option dtype must be one of 'float32', 'float16', 'bfloat16' or None, got 'float8'",
        ),
    ],
)
def test_invalid_option_values(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_options(None, **options)


def test_mode_resolution(monkeypatch):
    monkeypatch.delenv("ENGINEKIT_MODE", raising=False)
    assert resolve_mode(None) == "mp"
    monkeypatch.setenv("ENGINEKIT_MODE", "inproc")
    assert resolve_mode(None) == "inproc"
    assert resolve_mode("async") == "async"
    monkeypatch.setenv("ENGINEKIT_MODE", "threads")
    with pytest.raises(
        ValueError, match="ENGINEKIT_MODE must be one of 'inproc', 'mp', 'async', got 'threads'"
    ):
        resolve_mode(None)


def test_replace_validates():
    config = EngineConfig.from_options(None, max_num_seqs=4)
    assert config.replace(max_num_seqs=8).max_num_seqs == 8
    with pytest.raises(TypeError, match="unknown engine option"):
        config.replace(max_num_sequences=8)
